"""The target model's forward paths: loading, what a model can run (`target.TargetModel`), the lean forward and
its kernels, the static CUDA step, hidden-state features, the EAGLE head.
"""
