"""What the stages share for training (below the stages; no stage imports another):

context      StageContext (what a stage runs in) and the building of its TRL config
trainer      running a TRL trainer: resume, non-finite guard, saving, final metrics
rows         token rows for TRL (prompt/completion ids, masks), over-long rows dropped or counted
prompts      prompt data of the RL stages (ppo, rsft, rlvr) and its checks
pairs        preference pairs: normalised, rendered, on-policy pairs
rewards      verifiers as rewards (weights, unparseable counts, group signal)
scoring      reward-model scores of rendered conversations
actor_critic PPO's policy + critic (+ reference) models and its loop state
memory       will the step fit on the GPU (gradient checkpointing by default where not)
sharding     FSDP2/ZeRO: gathering parameters for generation, gathered saving
"""
