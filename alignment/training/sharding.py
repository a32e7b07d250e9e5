"""Whole models out of a prepared (possibly sharded) one: saving and sampling under FSDP2 and ZeRO-3.

Saving, `save_trained(accelerator, model, tokenizer, out_dir)`: every process calls it; the full state is
gathered and rank 0 writes it with `models.save_checkpoint` (merged weights, the adapter, the save dtype,
then the check that no tensor came out empty). The sharded model itself is left as it is.

Sampling, `gathered(accelerator, model)`: code that calls a prepared model's submodules directly (PPO's
`generate` and reference pass) instead of its forward needs the parameters whole for the duration:
under FSDP2 it runs as a forward of the root module (which gathers the root's own parameters; inner
units gather theirs in their own forward hooks), under ZeRO-3 inside `GatheredParameters`, with the
engine's fetch/release hooks off meanwhile, as TRL's `unwrap_model_for_generation` does. Under FSDP2
nothing written into gathered parameters lasts beyond the unit's next forward (it reshards and gathers
again), so LoRA is not merged in place there (`can_merge_lora`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
from pathlib import Path

import torch
from accelerate import init_empty_weights
from peft import PeftModel, get_peft_model
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from ..models.saving import save_checkpoint
from ..runtime.dist import engine_of, full_weights


def plain_class(module: torch.nn.Module) -> type:
    """The model class under FSDP2's wrapper (`fully_shard` swaps a module's class for a subclass of it)."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def unsharded_copy(model: torch.nn.Module, state_dict: dict, adapter: str = "default") -> torch.nn.Module:
    """A plain CPU model like `model` (a transformers model, or a PeftModel over one, of which only `adapter` is
    kept) holding `state_dict`, the full state gathered from the engine. Where that state is the model's own
    tensors (one process, DDP), the copy shares them: saving merges LoRA into them, so the trained model is done
    with once saved (every stage saves last)."""
    is_peft = isinstance(model, PeftModel)
    base = model.get_base_model() if is_peft else model
    with full_weights(), init_empty_weights(include_buffers=False):
        clone = plain_class(base)(base.config)
        if getattr(base, "generation_config", None) is not None:  # the checkpoint's own, not one built from config
            clone.generation_config = copy.deepcopy(base.generation_config)
        if is_peft:
            clone = get_peft_model(clone, copy.deepcopy(model.peft_config[adapter]), adapter_name=adapter)
    _, unexpected = clone.load_state_dict(state_dict, strict=False, assign=True)
    clone.tie_weights()
    missing = [name for name, tensor in clone.state_dict().items() if tensor.is_meta]
    if unexpected or missing:
        raise RuntimeError(
            f"the gathered state does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return clone.eval()


def save_trained(
    accelerator, model, tokenizer, out_dir: Path, dtype: torch.dtype | None = None, pick=None, save=None
) -> None:
    """Gather `model` (as prepared by `accelerator`) on every process, write it from rank 0 with `save`
    (default `models.save_checkpoint`). `pick(unwrapped, state) -> (model, state)` chooses a part to save (PPO:
    the policy of its actor-critic).

    accelerate's `get_state_dict` gathers the full state (a collective: FSDP2 and ZeRO-3 hand it to rank 0 only;
    under DDP and ZeRO-1/2 it is the model's own); rank 0 puts it into a plain copy of the model
    (`unsharded_copy`: built on the meta device and filled by assignment, so no second initialisation and no
    second copy of the weights) and writes it. The sharded model itself is left as it is."""
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        if pick is not None:
            unwrapped, state = pick(unwrapped, state)
        (save or save_checkpoint)(unsharded_copy(unwrapped, state), tokenizer, out_dir, dtype)
    accelerator.wait_for_everyone()


def can_merge_lora(accelerator) -> bool:
    """Whether LoRA may be merged into the weights while sampling (see the module docstring)."""
    return engine_of(accelerator.state) != "fsdp2"


def _direct_call(self, fn, *args, **kwargs):
    return fn(*args, **kwargs)


@contextlib.contextmanager
def gathered(accelerator, model):
    """Yields `call(fn, *args, **kwargs)`, which runs `fn` (code that calls submodules of the prepared `model`
    directly) with the parameters they need whole (see the module docstring). FSDP2 gathers each unit's
    parameters in that unit's forward, but the root's own, and its one-time initialisation, only in the root's
    forward, which direct calls skip: `call` is registered as a forward method of the root
    (`register_fsdp_forward_method`), so it runs the root's pre- and post-forward around `fn`."""
    engine = engine_of(accelerator.state)
    if engine == "fsdp2":
        if "direct_call" not in vars(model):
            model.direct_call = types.MethodType(_direct_call, model)
            register_fsdp_forward_method(model, "direct_call")
        yield model.direct_call
    elif engine == "zero3":
        import deepspeed
        from trl.models.utils import add_hooks, remove_hooks

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            remove_hooks(model)
            try:
                yield functools.partial(_direct_call, model)
            finally:
                add_hooks(model)
    else:
        yield functools.partial(_direct_call, model)
