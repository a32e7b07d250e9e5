"""The config layer: torch-free pydantic specs shared by the recipe and the stages.

    base      Strict (unknown keys are errors), did_you_mean, explain, stage references
    data      DataSpec: where a stage's rows come from
    model     TinySpec, LoraSpec
    sampling  SamplingSpec (+ VllmSpec, OnPolicySpec): the one sampling spec
    verifier  VerifierSpec: an entry of an RL stage's `verifiers:` list
    stage     StageConfig: keys every stage accepts
    evaluate  EvaluateSpec, SuiteSpec and the validation of a recipe's `evaluate:` block

Loading a recipe imports only this layer, `recipe.py` and the stage modules' configs: no torch, no
TRL (tests/test_layout.py holds it). This package imports none of its modules itself, so that each is
imported only where it is used.
"""
