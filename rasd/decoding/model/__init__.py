"""The target model's forward paths: loading, the lean forward and its kernels, the static CUDA step, hidden-
state features, the EAGLE head.
"""
