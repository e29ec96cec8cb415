"""Training the small learned parts of the drafters, on text the target itself generated (self-distillation).

`rasd train eesd` (EESD's exit layer, `rasd.train.eesd`) and `rasd train ldlp` (AdaEAGLE's draft length
predictor, `rasd.train.ldlp`). Artefacts go under $RASD_HOME (never into git).
"""
