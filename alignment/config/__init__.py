"""The config layer: torch-free pydantic specs shared by the recipe and the stages, and the recipe itself.

    base      Strict (unknown keys are errors), did_you_mean, explain, stage references
    data      DataSpec: where a stage's rows come from;  tasks: the built-in tasks' parameters
    model     TinySpec, GgufSpec, LoraSpec, TemplateSpec;  tools: ToolUse, a stage's tools and environment
    sampling  SamplingSpec (+ VllmSpec, OnPolicySpec): the one sampling spec
    verifier  VerifierSpec: an entry of an RL stage's `verifiers:` list
    stages/   StageConfig (keys every stage accepts) and each stage kind's `Config`
    evaluate  EvaluateSpec, SuiteSpec and the validation of a recipe's `evaluate:` block
    recipe    YAML -> validated `Recipe`: duplicate keys, overrides, interpolation, stage references
    reference the configuration reference rendered from these models: docs/config.md, `align keys KIND`

Every field carries a `description=` (what it does, its unit, its default, the paper behind it), which
`reference.py` renders into docs/config.md (tests/test_config_reference.py fails on a stale one). Loading a
recipe imports only this layer: no torch, no TRL. This package imports none of its modules itself.
"""
