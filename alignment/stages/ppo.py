"""`ppo` stage: RLHF with PPO and a per-token KL penalty, our own loop on `accelerate` (TRL 1.16 has none).

One update (Ziegler et al. 2019, arXiv:1909.08593; InstructGPT, arXiv:2203.02155): sample
`rollout.batch_size` prompts per process; score them (reward model + weighted verifiers - missing-EOS
penalty); take log-probs of the policy and of the reference, the critic's values, per-token rewards
r_t = -kl_coef * KL_t (+ the score at the last token) and GAE advantages; train `train.ppo_epochs` passes of
clipped policy + value loss over shuffled minibatches; update the KL coefficient. The math is in `rl.py`,
the models in `training/actor_critic.py`, one update's tensors in `training/rollout.py`.

Contract: one process (`align run`) or `accelerate launch` under DDP, FSDP2 or DeepSpeed ZeRO-1/2/3; batch
sizes are per process and only rank 0 writes files. Every `train.save_every` updates a checkpoint is written
in the work folder and a rerun resumes from it, training exactly as an uninterrupted run would. The final
policy is saved as merged weights + `adapter/`; the critic is not kept. `importance_sampling:` weighs each token's
policy term by trainer over sampler log-probs (`rl.importance_weights`); `rollout.server` samples on vLLM's server.
Limits: one completion per prompt; `rollout.backend: vllm` only where the engine keeps the weights whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import get_scheduler

from ..data.formatting import encode, render_prompt
from ..errors import UserError
from ..models.loading import default_dtype, load_reward_model
from ..models.tokenizer import load_tokenizer
from ..rl import (
    RunningMoments,
    explained_variance,
    gae_advantages,
    importance_weights,
    make_kl_controller,
    masked_mean,
    masked_whiten,
    penalized_rewards,
    policy_loss,
    prompt_completion_batch,
    value_loss,
)
from ..runtime.cpu import refuse_slow_bf16
from ..runtime.dist import PARTITIONED, check_engine
from ..runtime.progress import track
from ..sampling import generate, generate_ids, server
from ..training.actor_critic import (
    build_models,
    configure_deepspeed,
    load_loop_state,
    policy_state,
    save_loop_state,
)
from ..training.buckets import bucketed_order
from ..training.context import StageContext
from ..training.early_stop import GoldWatch
from ..training.health import report as report_health
from ..training.health import reward_trend
from ..training.memory import StepShape, needs_checkpointing
from ..training.prompt_filter import filter_rows
from ..training.prompts import prompt_of
from ..training.rewards import build_gold, build_rewards, gold_means, resolve_all
from ..training.rollout import Rollout, RolloutStats
from ..training.scoring import check_reward_model, implicit_reward_kl_note, score_texts
from ..training.sharding import can_merge_lora, gathered, save_trained
from ..training.trainer import NonFiniteError

log = logging.getLogger(__name__)

# Every update reseeds from (recipe seed, update, rank) instead of carrying RNG states across a resume, so a
# resumed run samples and trains exactly as an uninterrupted one. Two primes spread the three numbers apart:
# the seeds are distinct while rank < UPDATE_STRIDE and update * UPDATE_STRIDE + rank < SEED_STRIDE.
SEED_STRIDE = 1_000_003
UPDATE_STRIDE = 1_009
SCORE_STD_EPS = 1e-8  # added to the score's standard deviation before dividing by it (reward_norm)
MIN_SECONDS = 1e-9  # the smallest time a tokens/s rate divides by
METRIC_DIGITS = 6  # decimals kept of each logged float
# The logged keys that measure time, not training: they differ between runs that train alike.
TIMING_KEYS = ("rollout_tokens_per_s", "train_tokens_per_s", "update_seconds", "sample_seconds")
BEST_POLICY = "best_policy.pt"  # early_stop's kept policy state, in a loop checkpoint
LOG_KEYS = [
    "score",
    "rm_score",
    "kl",
    "kl_coef",
    "entropy",
    "policy_loss",
    "value_loss",
    "clipfrac",
    "approx_kl",
    "explained_variance",
    "response_length",
    "eos_fraction",
    "is_ratio_mean",
    "is_clipped_frac",
    "sampler_kl",
]  # shown in the log line (all are logged; the last three with importance_sampling only)


def update_seed(seed: int, update: int, rank: int) -> int:
    """The seed of update `update` (0-based) on process `rank`: a 32-bit mix of the three (see SEED_STRIDE)."""
    return (seed * SEED_STRIDE + update * UPDATE_STRIDE + rank) % 2**32


# ---------------------------------------------------------------------------------------------------
# Data, reward
# ---------------------------------------------------------------------------------------------------


def prompt_rows(ctx: StageContext, tokenizer, verifiers: list, gold: list = ()) -> tuple[list[dict], list[str]]:
    """Rows and their rendered prompts; checks columns (incl. the verifiers' and gold verifiers') and prompt lengths."""
    cfg, where = ctx.config, f"{ctx.where}.data"
    rows = ctx.load_prompt_rows(cfg.data, "data", verifiers, gold)
    prompts = [render_prompt(tokenizer, prompt_of(r)) for r in rows]
    limit = cfg.rollout.max_prompt_length
    if limit:
        keep = [i for i, p in enumerate(prompts) if len(encode(tokenizer, p)) <= limit]
        if not keep:
            raise UserError(f"{where}: every prompt is longer than rollout.max_prompt_length={limit} tokens.")
        if len(keep) < len(rows):
            log.info(f"[{where}] dropped {len(rows) - len(keep)} of {len(rows)} prompts longer than {limit} tokens")
        rows, prompts = [rows[i] for i in keep], [prompts[i] for i in keep]
    return rows, prompts


class Scorer:
    """The reward: sequence scores = reward model + weighted verifiers - `missing_eos_penalty` for a completion
    that never stopped (subtracted, as in TRL); `gold:` verifiers are scored on the same rollouts and logged
    (`gold/<name>`), never added to the score."""

    def __init__(self, ctx: StageContext, device):
        cfg, trust = ctx.config, ctx.recipe.trust_remote_code
        self.model = self.tokenizer = None
        if cfg.reward_model is not None:
            path = ctx.resolve_model(cfg.reward_model)
            self.model = load_reward_model(path, trust).to(device)
            self.tokenizer = load_tokenizer(path, trust)
            note = implicit_reward_kl_note(self.model, cfg.kl_coef, cfg.kl_target)
            if note and ctx.is_main:
                log.warning(f"[{ctx.where}] {note}")
        self.rewards = build_rewards(cfg.verifiers, [ctx.recipe.base_dir], ctx.where)
        self.gold = build_gold(cfg.gold, [ctx.recipe.base_dir], ctx.where)
        self.penalty = cfg.missing_eos_penalty

    def __call__(self, rows: list[dict], samples: list, batch_size: int):
        """(scores [B], {part: batch mean}). The reward model scores `render_prompt + render_completion`
        through `scoring.score_texts`, exactly the text the reward stage trained on."""
        texts = [s.text for s in samples]
        scores, parts = torch.zeros(len(samples)), {}
        if self.model is not None:
            rm = torch.tensor(
                score_texts(
                    self.model,
                    self.tokenizer,
                    [prompt_of(r) for r in rows],
                    texts,
                    batch_size,
                    finished=[s.finished for s in samples],
                )
            )
            scores, parts["rm_score"] = scores + rm, rm.mean().item()
        examples = [{**row, "prompt": prompt_of(row)} for row in rows]  # verifiers get the prompt, as in rsft
        for reward in self.rewards:
            values = torch.tensor([r.reward for r in reward.score(texts, examples)])
            scores, parts[f"verifier/{reward.__name__}"] = scores + reward.weight * values, values.mean().item()
        parts.update(gold_means(self.gold, texts, examples))
        if self.penalty is not None:
            finished = torch.tensor([s.finished for s in samples])
            scores = torch.where(finished, scores, scores - self.penalty)
        return scores, parts


# ---------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------


class PPOLoop:
    """One PPO run: `__init__` sets it up in named steps, `run()` does the updates, one method per phase.

    One name per role: `policy` is `actor_critic.policy` (it samples); the value function is the critic inside
    `actor_critic` (its values come out of the same forward call as the policy's log-probs); `reference_logprobs`
    scores under the reference (the starting policy); `reward` scores completions. `actor_critic` is the module
    as built, called directly for sampling and the rollout's no-grad passes; `wrapped` is the same module as the
    engine wrapped it (DDP, FSDP2, DeepSpeed), through which it is trained, gathered and saved.
    """

    def __init__(self, ctx: StageContext):
        self.ctx, self.config, self.train_spec = ctx, ctx.config, ctx.config.train
        self.accelerator, self.engine = self.setup_accelerator()
        set_seed(ctx.seed)  # the same fresh adapters/value head on every rank (DDP also broadcasts rank 0's)
        self.tokenizer = ctx.load_tokenizer()
        self.reward = Scorer(ctx, self.accelerator.device)
        self.rows, self.prompts = prompt_rows(
            ctx, self.tokenizer, [r.verifier for r in self.reward.rewards], [g.verifier for g in self.reward.gold]
        )
        kept, self.filtered = filter_rows(ctx, self.rows, self.reward.rewards, self.config.rollout)  # prompt_filter
        self.rows, self.prompts = [self.rows[i] for i in kept], [self.prompts[i] for i in kept]
        self.actor_critic, self.reference_logprobs = self.setup_models()
        self.total = self.total_updates()
        self.wrapped, self.optimizer, self.scheduler = self.setup_optimizer()
        self.kl_controller = make_kl_controller(self.config.kl_coef, self.config.kl_target, self.config.kl_horizon)
        self.accelerator.register_for_checkpointing(self.scheduler, self.kl_controller)
        # What the loop carries from update to update, all of it in the loop checkpoints.
        self.update, self.history, self.reward_moments = 0, [], RunningMoments()
        self._orders: dict[int, list[int]] = {}  # the prompt permutation of the current pass over the data
        self.watch = self.setup_early_stop()
        self.best_policy: dict | None = None  # the policy state at the watch's best (main process, CPU)
        self.stopped_at: int | None = None
        self.sampler_stats: dict[str, float] = {}  # this update's importance-sampling statistics, if corrected
        self.server: server.ServerRollouts | None = None  # `rollout.server`'s, while `run` runs
        self.async_stats: dict[str, float] = {}

    # -- setup --------------------------------------------------------------------------------------

    def setup_accelerator(self) -> tuple[Accelerator, str]:
        """The accelerator (trackers from the recipe's `report_to`) and its engine; vLLM sampling is refused
        under an engine that partitions the weights, since vLLM takes them whole for every rollout. Every engine
        runs in tests/test_distributed.py on 2 CPU processes (gloo); on GPUs the same code runs with NCCL."""
        report_to = self.ctx.recipe.report_to
        trackers = [r for r in ([report_to] if isinstance(report_to, str) else report_to) if r != "none"]
        accelerator = Accelerator(
            log_with=trackers or None,
            project_dir=str(self.ctx.out_dir / "logs"),
            gradient_accumulation_steps=self.train_spec.gradient_accumulation_steps,
        )
        engine = check_engine(accelerator.state, self.ctx.where)
        if engine in PARTITIONED and self.config.rollout.server is not None:
            raise UserError(
                f"{self.ctx.where}.rollout.server: the server is sent the policy's LoRA adapter whole after every "
                f"update, which {engine} partitions across processes; run under DDP or ZeRO-1/2, or sample with "
                "backend: transformers."
            )
        if engine in PARTITIONED and self.config.rollout.backend == "vllm":
            raise UserError(
                f"{self.ctx.where}.rollout.backend: vllm takes the policy's weights whole for every "
                f"rollout, which {engine} partitions across processes; that is not supported: sample with "
                "backend: transformers, or run under DDP or ZeRO-2."
            )
        return accelerator, engine

    def setup_models(self):
        """The actor-critic (policy + critic) and the reference's log-prob function (`actor_critic.build_models`:
        with LoRA one copy of the base weights serves all three), in eval mode: no dropout in the rollouts or in
        the PPO ratio. The reference copy of full fine-tuning and the reward model stay whole on every process."""
        models = build_models(self.ctx.start_model, self.ctx.lora, self.reward.model, self.ctx.recipe.trust_remote_code)
        if self.wants_checkpointing():
            models.actor_critic.enable_checkpointing()
        if models.reference is not None:
            models.reference.to(self.accelerator.device)
        return models.actor_critic.eval(), models.reference_logprobs

    def wants_checkpointing(self) -> bool:
        """The recipe's `train.gradient_checkpointing`, else the memory estimate for one micro-batch: the
        longest prompt plus `max_new_tokens`, a policy and a critic pass, logits for the completion only."""
        if self.train_spec.gradient_checkpointing is not None:
            return self.train_spec.gradient_checkpointing

        def micro_batch() -> StepShape:
            longest = max(len(encode(self.tokenizer, p)) for p in self.prompts)
            new_tokens = self.config.rollout.max_new_tokens
            return StepShape(
                self.micro_batch_size,
                longest + new_tokens,
                reference_copy=self.ctx.lora is None,
                lora_rank=self.ctx.lora.r if self.ctx.lora else None,
                critic=True,
                logit_length=new_tokens,
            )

        return needs_checkpointing(
            self.ctx.start_model,
            micro_batch,
            default_dtype().itemsize,
            self.ctx.recipe.trust_remote_code,
            f"{self.ctx.where}.train",
        )

    def total_updates(self) -> int:
        """`train.total_updates`, else enough for `train.total_episodes` (default: one pass over the prompts)."""
        train = self.train_spec
        if train.total_updates:
            return train.total_updates
        episodes = train.total_episodes or len(self.rows)
        return max(1, math.ceil(episodes / (self.config.rollout.batch_size * self.accelerator.num_processes)))

    def setup_optimizer(self):
        """(the engine-wrapped actor-critic, its AdamW with a policy and a critic group, the learning-rate
        schedule over every optimizer step of the run). The schedule is not passed to `prepare`: accelerate's
        wrapper would step it once per process."""
        train = self.train_spec
        groups = self.actor_critic.param_groups(
            train.learning_rate, train.critic_learning_rate or train.learning_rate, train.weight_decay
        )
        optimizer = torch.optim.AdamW(groups, lr=train.learning_rate)
        steps_per_update = train.ppo_epochs * (self.config.rollout.batch_size // train.mini_batch_size)
        scheduler = get_scheduler(
            train.lr_scheduler_type,
            optimizer,
            num_warmup_steps=train.warmup_steps,
            num_training_steps=self.total * steps_per_update,
        )
        if self.engine.startswith("zero"):
            configure_deepspeed(
                self.accelerator, self.micro_batch_size, train.gradient_accumulation_steps, train.max_grad_norm
            )
        wrapped, optimizer = self.accelerator.prepare(self.actor_critic, optimizer)
        return wrapped, optimizer, scheduler

    def setup_early_stop(self) -> GoldWatch | None:
        """`early_stop:`'s watch on a gold verifier (`training/early_stop.py`), or None."""
        stop = self.config.early_stop
        return GoldWatch(gold_key(self.ctx, self.reward.gold), stop.window, stop.patience) if stop else None

    @property
    def micro_batch_size(self) -> int:
        return self.train_spec.mini_batch_size // self.train_spec.gradient_accumulation_steps

    # -- the run ------------------------------------------------------------------------------------

    def run(self) -> dict:
        """Resume if a loop checkpoint exists, run the remaining updates, save the policy; the stage's metrics
        (the last update's, plus the run's) and log history."""
        self.resume()
        with self.open_server():
            return self.train_and_save()

    def open_server(self):
        """`rollout.server`'s vLLM server (started, or connected to) with `async`'s sampling ahead, stopped when the
        run ends, failed or not (`sampling/server.py`); a no-op context without it. Its log: logs/ in the output."""
        spec, staleness = self.config.rollout, self.config.async_.max_staleness if self.config.async_ else 0
        if spec.server is None:
            return contextlib.nullcontext()
        dtype = str(next(self.actor_critic.parameters()).dtype).removeprefix("torch.")
        where, logs = f"{self.ctx.where}.rollout", self.ctx.out_dir / "logs"
        opened = server.open_server(
            spec.server, str(self.ctx.start_model), spec.vllm, self.ctx.lora.r, dtype, logs, where
        )
        self.server = server.ServerRollouts(opened, staleness)
        return self.server

    def server_samples(self, encoded: list[list[int]], sampling) -> list:
        """This update's samples from the rollout server (`server.ServerRollouts.draw`), with `async`'s statistics."""
        samples, self.async_stats = self.server.draw(
            self.actor_critic.policy,
            self.tokenizer,
            encoded,
            sampling,
            (self.update, self.total),
            lambda update: [encode(self.tokenizer, self.prompts[i]) for i in self.prompt_indices(update)],
        )
        return samples

    def train_and_save(self) -> dict:
        """The updates left, the saved policy, the metrics (`run`)."""
        if self.accelerator.trackers:
            self.accelerator.init_trackers(f"{self.ctx.recipe.name}-{self.ctx.stage_id}")
        for _ in track(
            range(self.update, self.total), description=f"{self.ctx.stage_id} (ppo)", total=self.total - self.update
        ):
            entry = self.one_update()
            if entry is None:
                break
            self.history.append(entry)
            self.update += 1
            self.accelerator.log(entry, step=self.update)
            if self.update % self.train_spec.logging_steps == 0 or self.update == self.total:
                keys = [*LOG_KEYS, *(k for k in entry if k.startswith("gold/"))]
                shown = " ".join(f"{k}={entry[k]:.4g}" for k in keys if k in entry)
                log.info(f"[{self.ctx.stage_id}] {shown} ({self.update}/{self.total})")
            if self.update % self.train_spec.save_every == 0 and self.update < self.total:
                self.save_state()
        # Not `end_training()`: it destroys the process group the runner still uses.
        for tracker in self.accelerator.trackers:
            tracker.finish()
        self.save_final()
        metrics = dict(self.history[-1]) if self.history else {}
        metrics.update(
            updates=self.update, prompts=len(self.rows), start_score=self.history[0]["score"] if self.history else None
        )
        if self.watch is not None:
            metrics.update(
                {
                    "early_stop/best_update": self.watch.best_update or None,
                    "early_stop/best_gold": self.watch.best if self.watch.best_update else None,
                    "early_stop/stopped_at": self.stopped_at,
                }
            )
        metrics.update(
            **self.filtered,
            **{k: v for r in self.reward.rewards for k, v in r.totals().items()},
            **reward_trend(self.history, "score", "score_std"),
        )
        return {"metrics": report_health("ppo", self.ctx.stage_id, metrics), "log_history": self.history}

    def one_update(self) -> dict | None:
        """One rollout and its training; None when `early_stop` ends the run at this rollout (not trained on).
        Randomness is reseeded first (`update_seed`), so any update samples and trains the same resumed or not."""
        set_seed(update_seed(self.ctx.seed, self.update, self.accelerator.process_index))
        update_started = time.time()
        rollout, rollout_stats = self.rollout()
        if self.watch is not None and self.watch_gold(rollout_stats):
            return None
        rollout, stats = self.advantages(rollout)
        stats.update(self.sampler_stats, **self.async_stats)
        started = time.time()
        stats.update(self.train_on(rollout))
        train_time = time.time() - started
        entry = self.metrics(rollout, rollout_stats, stats, train_time)
        # Wall seconds of this update on this process (rollout, scoring, training): 60 / update_seconds is the
        # updates a minute that `async:` is measured by; sample_seconds is the part spent waiting for samples.
        entry.update(
            update_seconds=round(time.time() - update_started, 3), sample_seconds=round(rollout_stats.sample_seconds, 3)
        )
        self.kl_controller.update(entry["kl"], self.config.rollout.batch_size * self.accelerator.num_processes)
        return entry

    # -- rollout ------------------------------------------------------------------------------------

    def prompt_indices(self, update: int | None = None) -> list[int]:
        """This process's prompts for `update` (default: the current one): consecutive slices of seeded
        permutations, one permutation per pass over the data, so any update's prompts follow from its number."""
        n, per = len(self.rows), self.config.rollout.batch_size
        update = self.update if update is None else update
        start = (update * self.accelerator.num_processes + self.accelerator.process_index) * per
        picked = []
        for pos in range(start, start + per):
            epoch = pos // n
            if epoch not in self._orders:
                self._orders = {epoch: random.Random(f"{self.ctx.seed}-{epoch}").sample(range(n), n)}
            picked.append(self._orders[epoch][pos % n])
        return picked

    def rollout(self) -> tuple[Rollout, RolloutStats]:
        """Sample, score, and compute old log-probs, reference log-probs, values and entropy. Sampling and the
        reference pass call the policy directly, with the parameters gathered for them (`sharding.gathered`)."""
        spec, started, device = self.config.rollout, time.time(), self.accelerator.device
        indices = self.prompt_indices()
        rows, prompts = [self.rows[i] for i in indices], [self.prompts[i] for i in indices]
        sampling = spec if can_merge_lora(self.accelerator) else spec.model_copy(update={"merge_lora": False})
        encoded = [encode(self.tokenizer, p) for p in prompts]
        with gathered(self.accelerator, self.wrapped) as call:
            if self.server is not None:
                samples = self.server_samples(encoded, sampling)
            elif self.config.importance_sampling is None:
                samples = call(generate, self.actor_critic.policy, self.tokenizer, prompts, sampling)
            else:  # the same samples, with the sampler's processed log-probs
                samples = call(
                    generate_ids, self.actor_critic.policy, self.tokenizer, encoded, sampling, processed=True
                )
        sample_seconds = time.time() - started
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids, attention, mask = prompt_completion_batch(encoded, [s.token_ids for s in samples], pad, device)
        scores, parts = self.reward(rows, samples, self.micro_batch_size)
        width = mask.shape[1]  # response columns
        chunks = length_chunks(attention, self.micro_batch_size)
        unsort = torch.argsort(torch.cat([chunk_rows for chunk_rows, _ in chunks]))
        with torch.no_grad():
            outs = [
                self.actor_critic(
                    ids[chunk_rows, start:], attention[chunk_rows, start:], width, spec.temperature, with_entropy=True
                )
                for chunk_rows, start in chunks
            ]
            logprobs, values, entropy = (torch.cat(x)[unsort] for x in zip(*outs))
            with gathered(self.accelerator, self.wrapped) as call:
                ref_logprobs = torch.cat(
                    [
                        call(
                            self.reference_logprobs,
                            ids[chunk_rows, start:],
                            attention[chunk_rows, start:],
                            width,
                            spec.temperature,
                        )
                        for chunk_rows, start in chunks
                    ]
                )[unsort]
        rollout = Rollout(
            query_responses=ids,
            attention_mask=attention,
            response_mask=mask,
            logprobs=logprobs,
            ref_logprobs=ref_logprobs,
            values=values,
            entropy=entropy,
            scores=scores.to(device),
            finished=torch.tensor([s.finished for s in samples], device=device),
            is_weights=self.sampler_correction(samples, logprobs, mask),
        )
        return rollout, RolloutStats(reward_means=parts, sample_seconds=sample_seconds)

    def sampler_correction(self, samples: list, logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """`importance_sampling:`'s weights [B, T] of the trainer's log-probs at sampling time (`logprobs`, the
        policy the loss clips against) over the sampler's processed ones (`rl.importance_weights`), or None
        without it. Their statistics, over every process (max: the largest), go into the update's log entry."""
        spec = self.config.importance_sampling
        if spec is None:
            return None
        width = mask.shape[1]
        sampler = torch.tensor(
            [(s.processed_logprobs or [])[:width] + [0.0] * (width - len(s.processed_logprobs or [])) for s in samples],
            device=logprobs.device,
        )
        missing = sum(s.processed_logprobs is None or len(s.processed_logprobs) < len(s.token_ids) for s in samples)
        if missing:
            raise UserError(
                f"{self.ctx.where}.importance_sampling: the sampler returned no processed log-probs for {missing} of "
                f"{len(samples)} samples, so their importance weights cannot be computed; use `rollout.backend: "
                "transformers` or `vllm`, or drop importance_sampling."
            )
        weights, stats = importance_weights(logprobs, sampler, mask, spec.level, spec.mode, spec.cap, spec.low)
        everyone = self.accelerator.gather(torch.stack([stats["is_ratio_max"]]).float())
        self.sampler_stats = {k: v.item() for k, v in stats.items() if k != "is_ratio_max"}
        self.sampler_stats["is_ratio_max"] = everyone.max().item()
        return weights

    def watch_gold(self, rollout_stats: RolloutStats) -> bool:
        """`early_stop`: record this rollout's gold mean (over all processes); on a new best window average keep a
        copy of the policy that sampled it; True once `patience` updates have passed without one."""
        local = torch.tensor(float(rollout_stats.reward_means[self.watch.key]), device=self.accelerator.device)
        update = self.update + 1
        if self.watch.observe(update, self.accelerator.reduce(local, "mean").item()):
            self.best_policy = self.policy_copy()
        if not self.watch.exhausted(update):
            return False
        self.stopped_at = update
        log.info(
            f"[{self.ctx.stage_id}] early stop at update {update}: the {self.watch.key} average over "
            f"{self.watch.window} updates has not passed {self.watch.best:.4g} (update {self.watch.best_update}) "
            f"for {update - self.watch.best_update} updates; this rollout is not trained on"
        )
        return True

    def policy_copy(self) -> dict | None:
        """The policy's gathered state, copied to CPU on the main process (every process takes part in the
        gather; the others get None)."""
        state = self.accelerator.get_state_dict(self.wrapped)
        if not self.accelerator.is_main_process:
            return None
        _, policy = policy_state(self.accelerator.unwrap_model(self.wrapped), state)
        return {k: v.detach().to("cpu", copy=True) for k, v in policy.items()}

    # -- rewards and advantages ---------------------------------------------------------------------

    def normalise(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores as the reward: raw, or standardised by this batch's (all processes) or running statistics
        (`rl.RunningMoments`), then clipped to [-reward_clip, reward_clip] if set."""
        norm = self.train_spec.reward_norm
        if norm != "none":
            everyone = self.accelerator.gather(scores).float()
            if norm == "batch":
                mean, std = everyone.mean(), everyone.std() if len(everyone) > 1 else torch.tensor(1.0)
            else:
                self.reward_moments.update(everyone.tolist())
                mean, std = torch.tensor(self.reward_moments.mean), torch.tensor(self.reward_moments.std)
            scores = (scores - mean.to(scores.device)) / (std.to(scores.device) + SCORE_STD_EPS)
        if self.train_spec.reward_clip is not None:
            scores = scores.clamp(-self.train_spec.reward_clip, self.train_spec.reward_clip)
        return scores

    def advantages(self, rollout: Rollout) -> tuple[Rollout, dict]:
        """The rollout with GAE advantages and returns of the KL-penalised rewards, and its statistics."""
        train, mask, kl_coef = self.train_spec, rollout.response_mask, self.kl_controller.value
        rewards, kl = penalized_rewards(
            self.normalise(rollout.scores),
            rollout.logprobs,
            rollout.ref_logprobs,
            mask,
            kl_coef,
            self.config.kl_estimator,
        )
        advantages, returns = gae_advantages(rewards, rollout.values, mask, train.gamma, train.lam)
        if train.whiten_advantages and mask.sum() > 1:
            advantages = masked_whiten(advantages, mask)
        stats = {
            "kl": kl.sum(1).mean().item(),
            "non_score_reward": (-kl_coef * kl).sum(1).mean().item(),
            "entropy": masked_mean(rollout.entropy, mask).item(),
            "explained_variance": explained_variance(rollout.values, returns, mask).item() if mask.sum() > 1 else 0.0,
            "value_mean": masked_mean(rollout.values, mask).item(),
        }
        return dataclasses.replace(rollout, advantages=advantages, returns=returns), stats

    # -- optimisation -------------------------------------------------------------------------------

    def train_on(self, rollout: Rollout) -> dict:
        """`ppo_epochs` passes of shuffled minibatches (`mini_batch_size` rows per optimizer step, split into
        `gradient_accumulation_steps` micro-batches); returns the mean loss statistics."""
        train, size = self.train_spec, len(rollout)
        mini, accum, micro_size = train.mini_batch_size, train.gradient_accumulation_steps, self.micro_batch_size
        totals: dict[str, float] = {}
        count, tokens, norms = 0, 0, []
        for _ in range(train.ppo_epochs):
            order = self.minibatch_order(rollout)
            for start in range(0, size, mini):
                rows = order[start : start + mini]
                local_loss = 0.0
                for j in range(accum):
                    micro = rows[j * micro_size : (j + 1) * micro_size]
                    # accelerate's accumulation: no gradient sync before the last micro-batch (DDP, FSDP2), the
                    # loss divided by `accum` (DeepSpeed divides it itself and steps at the last one)
                    with self.accelerator.accumulate(self.wrapped):
                        loss, stats, n_tokens = self.micro_loss(rollout[micro.to(rollout.device)].trimmed())
                        self.accelerator.backward(loss)
                    local_loss += loss.item() / accum
                    tokens += n_tokens
                    for key, value in stats.items():
                        totals[key] = totals.get(key, 0.0) + value
                    count += 1
                norms.append(self.step(local_loss))
        stats = {key: value / count for key, value in totals.items()}
        stats.update(grad_norm=sum(norms) / len(norms), train_tokens=tokens)
        return stats

    def minibatch_order(self, rollout: Rollout) -> torch.Tensor:
        """One epoch's row order, cut into minibatches by the caller: a random permutation, or with
        `train_sampling_strategy: bucket_by_length` minibatches of rows of about one length in random order
        (`buckets.bucketed_order`). Each minibatch then trims to its own longest row (`Rollout.trimmed`), so
        where a few prompts are much longer, most minibatches stop paying for them (measured:
        docs/performance.md#length-buckets)."""
        if self.train_spec.train_sampling_strategy == "random":
            return torch.randperm(len(rollout))
        return bucketed_order(rollout.attention_mask.sum(1).tolist(), self.train_spec.mini_batch_size)

    def micro_loss(self, micro: Rollout):
        """Clipped policy loss + vf_coef * clipped value loss on a micro-batch, both masked by its
        `response_mask`; its statistics and its number of tokens."""
        train = self.train_spec
        logprobs, values, _ = self.wrapped(
            micro.query_responses, micro.attention_mask, micro.response_width, self.config.rollout.temperature
        )
        pg, pg_stats = policy_loss(
            logprobs, micro.logprobs, micro.advantages, micro.response_mask, train.cliprange, weights=micro.is_weights
        )
        vf, vf_stats = value_loss(values, micro.values, micro.returns, micro.response_mask, train.cliprange_value)
        stats = {"policy_loss": pg.item(), "value_loss": vf.item()}
        stats.update({name: value.item() for name, value in {**pg_stats, **vf_stats}.items()})
        return pg + train.vf_coef * vf, stats, int(micro.attention_mask.sum().item())

    def step(self, local_loss: float) -> float:
        """Clip, check, step. A non-finite loss or gradient on any process stops every process before
        the optimizer step, so the weights and the last checkpoint stay intact. (DeepSpeed clips and steps
        inside the last micro-batch's backward pass; there the stop comes after its step, and the last
        checkpoint stays intact.)"""
        max_norm = self.train_spec.max_grad_norm or float("inf")
        norm = float(self.accelerator.clip_grad_norm_(self.wrapped.parameters(), max_norm))
        bad = torch.tensor(
            0.0 if math.isfinite(local_loss) and math.isfinite(norm) else 1.0, device=self.accelerator.device
        )
        if self.accelerator.reduce(bad, reduction="sum").item() > 0:
            raise NonFiniteError(
                f"stage '{self.ctx.stage_id}': non-finite loss ({local_loss}) or gradient norm ({norm}) at update "
                f"{self.update + 1}; stopped before the optimizer step. The last checkpoint in {self.ctx.work_dir} is "
                "intact; lower train.learning_rate, check the reward scores (train.reward_norm / reward_clip), or "
                "use fp32/bf16 instead of fp16."
            )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # -- metrics ------------------------------------------------------------------------------------

    def metrics(self, rollout: Rollout, rollout_stats: RolloutStats, stats: dict, train_time: float) -> dict:
        """Per-update metrics averaged over processes (scores over the gathered batch)."""
        accelerator = self.accelerator
        scores = accelerator.gather(rollout.scores.float())
        lengths = rollout.response_mask.sum(1)
        local = {
            **rollout_stats.reward_means,
            **{k: v for k, v in stats.items() if k != "train_tokens"},
            "response_length": lengths.mean().item(),
            "eos_fraction": rollout.finished.float().mean().item(),
        }
        names = sorted(local)
        means = accelerator.reduce(torch.tensor([float(local[n]) for n in names], device=accelerator.device), "mean")
        sums = accelerator.reduce(
            torch.tensor([lengths.sum().item(), float(stats["train_tokens"])], device=accelerator.device), "sum"
        )
        entry = {
            "update": self.update + 1,
            "episodes": (self.update + 1) * len(scores),
            "score": scores.mean().item(),
            "score_std": scores.std().item() if len(scores) > 1 else 0.0,
            **{n: v for n, v in zip(names, means.tolist())},
            "kl_coef": self.kl_controller.value,
            "learning_rate": self.scheduler.get_last_lr()[0],
            "rollout_tokens_per_s": sums[0].item() / max(rollout_stats.sample_seconds, MIN_SECONDS),
            "train_tokens_per_s": sums[1].item() / max(train_time, MIN_SECONDS),
        }
        return {k: round(v, METRIC_DIGITS) if isinstance(v, float) else v for k, v in entry.items()}

    # -- checkpoints --------------------------------------------------------------------------------

    def save_final(self) -> None:
        """The trained policy as the stage's checkpoint (merged weights + adapter): gathered from every
        process, written by rank 0 (`sharding.save_trained`); under `early_stop`, the policy kept at the best."""
        self.accelerator.wait_for_everyone()
        pick = policy_state
        if self.watch is not None and self.watch.best_update:  # the same on every process (reduced gold means)
            log.info(
                f"[{self.ctx.stage_id}] saving the policy that sampled update {self.watch.best_update}'s rollouts "
                f"(best {self.watch.key} average {self.watch.best:.4g}), not the last one"
            )
            pick = self.kept_policy
        save_trained(self.accelerator, self.wrapped, self.tokenizer, self.ctx.out_dir, self.ctx.save_dtype(), pick=pick)

    def kept_policy(self, actor_critic, _gathered: dict) -> tuple:
        """`save_trained`'s pick under `early_stop`: the policy module, with the state kept at the best."""
        return actor_critic.policy, self.best_policy

    def save_state(self) -> None:
        """A loop checkpoint in the work folder (`actor_critic.save_loop_state`: model, optimizer, scheduler and
        KL controller, each engine's shards written by every process), plus the update, the running reward
        statistics, the log history and early_stop's watch and kept policy."""
        state = {"update": self.update, "reward_stats": self.reward_moments.state_dict(), "log_history": self.history}
        files = {}
        if self.watch is not None:
            state["early_stop"] = self.watch.state()
            files = {BEST_POLICY: self.best_policy} if self.best_policy is not None else {}
        save_loop_state(self.accelerator, Path(self.ctx.work_dir), self.update, state, files)

    def resume(self) -> None:
        """Restore the newest loop checkpoint, if any (`save_state`)."""
        state, path = load_loop_state(self.accelerator, Path(self.ctx.work_dir))
        if state is not None:
            self.update, self.history = state["update"], state["log_history"]
            self.reward_moments.load_state_dict(state["reward_stats"])
            if self.watch is not None and "early_stop" in state:
                self.watch.restore(state["early_stop"])
                if self.watch.best_update and self.accelerator.is_main_process:
                    self.best_policy = torch.load(path / BEST_POLICY, weights_only=True)
            log.info(f"[{self.ctx.stage_id}] resuming from update {self.update} ({path})")


def length_chunks(attention_mask: torch.Tensor, size: int) -> list[tuple[torch.Tensor, int]]:
    """The rows of a left-padded batch [B, P+T] in chunks of `size` for the rollout's no-grad passes, as
    (row indices, first column any of them uses): rows sorted by length, so each chunk's forward starts at its
    own longest prompt rather than the batch's (the outputs at the last K columns do not change: position ids
    count from each row's first token)."""
    order = torch.argsort(attention_mask.sum(1), stable=True)
    chunks = []
    for rows in order.split(size):
        used = attention_mask[rows].any(0).nonzero()
        chunks.append((rows, int(used[0]) if len(used) else 0))
    return chunks


def gold_key(ctx: StageContext, gold: list) -> str:
    """The logged name of the gold verifier `early_stop.gold` watches."""
    names = [g.__name__ for g in gold]
    key = f"gold/{ctx.config.early_stop.gold}"
    if key not in names:
        raise UserError(
            f"{ctx.where}.early_stop.gold: '{ctx.config.early_stop.gold}' is logged under another name; "
            f"the gold verifiers are logged as {', '.join(names)}: name one of those (without gold/)."
        )
    return key


# ---------------------------------------------------------------------------------------------------
# Stage entry points
# ---------------------------------------------------------------------------------------------------


def check(ctx: StageContext) -> None:
    refuse_slow_bf16(ctx.config, ctx.where)
    tokenizer = ctx.load_tokenizer()
    prompt_rows(
        ctx,
        tokenizer,
        resolve_all(ctx.config.verifiers, [ctx.recipe.base_dir], ctx.where),
        resolve_all(ctx.config.gold, [ctx.recipe.base_dir], ctx.where, entry="gold"),
    )
    if ctx.config.early_stop is not None:
        gold_key(ctx, build_gold(ctx.config.gold, [ctx.recipe.base_dir], ctx.where))
    if ctx.config.rollout.server is not None:  # every process shares one server (`server.open_server`)
        server.check_settings(ctx.config.rollout.server, ctx.config.rollout.vllm, ctx.lora, 1, ctx.where)
    ref = ctx.config.reward_model
    if ref is not None:
        check_reward_model(ref, ctx.resolve_model(ref), f"{ctx.where}.reward_model", ctx.recipe.trust_remote_code)


def run(ctx: StageContext) -> dict:
    return PPOLoop(ctx).run()
