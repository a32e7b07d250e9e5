"""Model loading, one concern a module (imports point down this list):

loading    policies and reward models; adapter folders; does a model source resolve
implicit_reward  a dpo stage's output as a reward model: beta * (log pi - log ref) of an answer
tokenizer  the tokenizer every stage uses (pad token, the recipe's template settings)
lora       peft LoRA configs, applying them, checking target modules
saving     a trained model as a plain checkpoint (LoRA merged), read back
tiny       the offline tiny model and its character tokenizer
gguf       GGUF files converted into a Hugging Face folder
"""
