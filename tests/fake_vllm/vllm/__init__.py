"""A stand-in for the parts of vLLM that `alignment.sampling.vllm_engine` uses, for the default test suite (the
real engine runs in tests/vllm_cpu/, in an environment of its own). It mirrors vLLM 0.32's interface on a GPU:
`LLM(...)` with `load_format="dummy"` (random weights until some are loaded),
`collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`, `apply_model(fn)`,
`reset_prefix_cache()`, `llm_engine.model_config.max_model_len`, `llm_engine.engine_core.shutdown()`,
`vllm.platforms.current_platform` (a GPU: sleep mode available), and `generate(prompts, sampling_params)`
returning request outputs whose completions carry `token_ids` (the stop token included, as vLLM keeps it),
`logprobs` (per token a {token id: Logprob}) and `finish_reason`. Sampling and log-probs come from
transformers.

Sleep mode (`enable_sleep_mode`, `sleep(level)`, `wake_up(tags)`) is tracked: generating or loading
weights into a sleeping part fails, and level 2 scrambles the weights as discarding them would.

Starting an `LLM` has the side effects the real one has on its process (reseeded generators, torch's thread
count and `torch.set_num_threads` taken over), so tests can check they are undone.

Test knobs on `LLM`: `fail_with` (an exception the constructor raises), `ignore_weights` (load_weights
silently keeps the dummy weights), and `instances` / `pushes` to count what happened.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

__version__ = "0.32.0+fake"


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class _Weights:
    """What `model_runner.model` is in vLLM: here, a transformers model with vLLM's `load_weights`."""

    def __init__(self, hf_model, owner):
        self.hf_model, self.owner = hf_model, owner

    def load_weights(self, weights) -> set[str]:
        params = dict(self.hf_model.named_parameters())
        tied = self.hf_model.config.tie_word_embeddings
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and tied:
                continue
            if name not in params:
                raise KeyError(f"fake vllm: no parameter named {name!r}")
            assert "weights" not in self.owner.asleep, "fake vllm: weights loaded into a sleeping engine"
            if not LLM.ignore_weights:
                params[name].data.copy_(tensor)
            loaded.add(name)
        LLM.pushes += 1
        return loaded


class LLM:
    fail_with: Exception | None = None
    ignore_weights = False
    instances: list[LLM] = []
    pushes = 0

    def __init__(
        self,
        model: str,
        *,
        load_format: str = "auto",
        dtype: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.92,
        max_model_len: int | None = None,
        distributed_executor_backend: str | None = None,
        tensor_parallel_size: int = 1,
        logprobs_mode: str = "raw_logprobs",
        enable_sleep_mode: bool = False,
        **kwargs,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM

        if LLM.fail_with is not None:
            raise LLM.fail_with
        self.kwargs = dict(
            model=model,
            load_format=load_format,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            distributed_executor_backend=distributed_executor_backend,
            tensor_parallel_size=tensor_parallel_size,
            logprobs_mode=logprobs_mode,
            enable_sleep_mode=enable_sleep_mode,
            **kwargs,
        )
        assert load_format == "dummy", "the fake only implements dummy weights"
        self.environment = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        config = AutoConfig.from_pretrained(model)
        with torch.random.fork_rng():
            torch.manual_seed(1234)  # dummy weights: random, and unlike any trained model's
            self._model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).eval()
        # What starting vLLM's worker in the caller's process does to it (set_random_seed in vllm/utils/
        # torch_utils.py; init_device in v1/worker/cpu_worker.py): the global generators reseeded, torch on one
        # thread, and torch.set_num_threads a no-op from then on.
        random.seed(seed)
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        torch.set_num_threads = lambda threads: None
        self._weights = _Weights(self._model, self)
        self.shut_down = False
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=max_model_len or config.max_position_embeddings),
            engine_core=SimpleNamespace(shutdown=lambda: setattr(self, "shut_down", True)),
        )
        self.prefix_cache_resets, self.applied = 0, []
        self.enable_sleep_mode, self.asleep, self.sleeps = enable_sleep_mode, set(), 0
        LLM.instances.append(self)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert method == "reload_weights", f"fake vllm: no worker method {method!r}"
        assert (kwargs or {}).get("is_checkpoint_format", True)
        return [self._weights.load_weights(kwargs["weights_iterator"])]

    def apply_model(self, func):
        self.applied.append(func.__name__)
        return [func(self._model)]

    def sleep(self, level: int = 1, mode: str = "abort"):
        assert self.enable_sleep_mode, "fake vllm: sleep without enable_sleep_mode"
        self.sleeps += 1
        self.asleep = {"weights", "kv_cache"}
        if level == 2:  # the weights are discarded, as vLLM does: only a push brings them back
            with torch.no_grad():
                for param in self._model.parameters():
                    param.normal_()

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.asleep -= set(tags or ("weights", "kv_cache"))
        return not self.asleep

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.prefix_cache_resets += 1
        return True

    @torch.no_grad()
    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, **kwargs) -> list[RequestOutput]:
        assert not self.asleep, f"fake vllm: generate while {self.asleep} sleep"
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params] * len(prompts)
        return [self._one(prompt["prompt_token_ids"], params) for prompt, params in zip(prompts, sampling_params)]

    def _one(self, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
        stops = list(params.stop_token_ids or [])
        if self._model.config.eos_token_id is not None and self._model.config.eos_token_id not in stops:
            stops.append(self._model.config.eos_token_id)
        sample = params.temperature > 0
        ids = torch.tensor([prompt_ids] * params.n)
        room = self.llm_engine.model_config.max_model_len - len(prompt_ids)  # vLLM stops at max_model_len
        with torch.random.fork_rng():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            out = self._model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=min(params.max_tokens, room),
                do_sample=sample,
                temperature=params.temperature if sample else None,
                top_p=params.top_p if sample else None,
                top_k=(params.top_k or None) if sample else None,
                eos_token_id=stops,
                pad_token_id=stops[0],
                output_logits=True,
                return_dict_in_generate=True,
                repetition_penalty=params.repetition_penalty,
                min_p=params.min_p or None,
                min_new_tokens=params.min_tokens or None,
            )
        new = out.sequences[:, len(prompt_ids) :].tolist()
        raw = torch.stack(out.logits, dim=1).float().log_softmax(-1)  # [n, steps, vocab], before temperature
        request = RequestOutput(prompt_token_ids=list(prompt_ids))
        for k, row in enumerate(new):
            end = next((t for t, token in enumerate(row) if token in stops), None)
            kept = row if end is None else row[: end + 1]
            logprobs = [{token: Logprob(raw[k, t, token].item(), 1)} for t, token in enumerate(kept)]
            request.outputs.append(
                CompletionOutput(
                    k, kept, logprobs if params.logprobs is not None else None, "stop" if end is not None else "length"
                )
            )
        return request


platforms = SimpleNamespace(
    current_platform=SimpleNamespace(device_name="fake GPU", is_cpu=lambda: False, is_sleep_mode_available=lambda: True)
)
sys.modules[__name__ + ".platforms"] = platforms
