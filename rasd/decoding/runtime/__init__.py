"""Request state around the step: the single-request engine, the continuous-batching scheduler, the compute
thread, the prefix cache, statistics.
"""
