"""`ppo` stage: RLHF with PPO and a per-token KL penalty, our own loop on `accelerate` (TRL 1.16 has none).

One update (Ziegler et al. 2019, arXiv:1909.08593; InstructGPT, arXiv:2203.02155):
  1. rollout: `rollout.batch_size` prompts per process, sampled through `sampling.generate`
     (temperature, top-p, stop at the end-of-turn token);
  2. score: the reward model on `render_prompt + render_completion` (the shared formatting), plus
     weighted verifier rewards, minus `missing_eos_penalty` for completions that never stopped;
     optional normalisation/clipping (`train.reward_norm`, `train.reward_clip`);
  3. log-probs of the policy, of the reference (the starting policy: LoRA adapters disabled) and the
     critic's values; r_t = -kl_coef * KL_t + score at the last token; GAE advantages and returns;
  4. `train.ppo_epochs` passes over shuffled minibatches (`train.mini_batch_size` rows per optimizer
     step, split into `gradient_accumulation_steps` micro-batches): clipped policy loss +
     `vf_coef` * clipped value loss, gradient clipping, one AdamW step (policy and critic groups);
  5. the KL controller updates `kl_coef` (adaptive when `kl_target` is set).
The math is in `alignment/rl.py`, the models in `alignment/training/actor_critic.py` (with LoRA ONE copy of the
base weights serves policy, reference and critic).
One update's tensors travel as a `Rollout` (`alignment/training/rollout.py`): each with its shape, checked
when built, and sliced together for minibatches; the reward-part means and sampling time as `RolloutStats`.

Recipe keys: `policy` (start policy, default the previous policy stage), `reward_model` ("${rm}" or a
path/hub id; a reward stage's `ensemble:` is scored as its combination), `verifiers: [{name, weight, options}]`,
`gold:` (verifiers scored and logged as `gold/<name>`, never rewarded), `early_stop:` (keep the policy where a
gold measure peaked: `training/early_stop.py`), `data` (a `prompt` or `messages` column, plus
the columns the verifiers need), `kl_coef`, `kl_target`, `kl_horizon`, `kl_estimator`, `rollout`,
`missing_eos_penalty` and `train` (see `TrainSpec`; unknown keys are errors with a "did you mean").
Warm the learning rate up (`train.warmup_steps`, `lr_scheduler_type: cosine`): in the quickstart, PPO
with warm-up gained 9 points of held-out accuracy where a similar run without it lost 8.

Runs: `align run RECIPE` (one process) or `accelerate launch -m alignment run RECIPE` with DDP, FSDP2 or
DeepSpeed ZeRO-1/2/3 (each process samples its own prompt shard; batch sizes are per process; only rank 0
writes files). The actor-critic is what the engine wraps; generation and the reference pass call its
policy directly, with the parameters gathered for them (`sharding.gathered`); the reference copy (full
fine-tuning) and the reward model stay whole on every process. Tested on 2 CPU processes (gloo) under
each engine in tests/test_distributed.py; on GPUs the same code runs with NCCL.

Checkpoints: every `train.save_every` updates into `.work/<stage>/checkpoint-N` with
`accelerator.save_state` (model, optimizer, scheduler and KL controller, each engine's shards written by
every process) plus the update, reward statistics and log history, written to a temporary folder and
renamed; a rerun resumes from the newest. Instead of relying on RNG states, randomness is reseeded from
(seed, update, rank) at every update, so a resumed run samples and trains exactly as an uninterrupted one
(the tests check the final weights). The final policy is gathered and saved by `sharding.save_trained`
(merged weights + `adapter/`); the critic is not kept. `missing_eos_penalty` is subtracted from the
score, as in TRL.
"""

from __future__ import annotations

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
    explained_variance,
    gae_advantages,
    make_kl_controller,
    masked_mean,
    masked_whiten,
    penalized_rewards,
    policy_loss,
    prompt_completion_batch,
    value_loss,
)
from ..runtime.dist import PARTITIONED, check_engine
from ..runtime.progress import track
from ..sampling import generate
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
from ..training.memory import StepShape, needs_checkpointing
from ..training.prompts import prompt_of
from ..training.rewards import build_gold, build_rewards, gold_means, resolve_all
from ..training.rollout import Rollout, RolloutStats
from ..training.scoring import check_reward_model, score_texts
from ..training.sharding import can_merge_lora, gathered, save_trained
from ..training.trainer import NonFiniteError

log = logging.getLogger(__name__)


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
    """Sequence scores: reward model + weighted verifiers - missing-EOS penalty; `gold:` verifiers are scored
    on the same rollouts and logged (`gold/<name>`), never added to the score."""

    def __init__(self, ctx: StageContext, device):
        cfg, trust = ctx.config, ctx.recipe.trust_remote_code
        self.model = self.tokenizer = None
        if cfg.reward_model is not None:
            path = ctx.resolve_model(cfg.reward_model)
            self.model = load_reward_model(path, trust).to(device)
            self.tokenizer = load_tokenizer(path, trust)
        self.rewards = build_rewards(cfg.verifiers, [ctx.recipe.base_dir], ctx.where)
        self.gold = build_gold(cfg.gold, [ctx.recipe.base_dir], ctx.where)
        self.penalty = cfg.missing_eos_penalty

    def __call__(self, rows: list[dict], samples: list, batch_size: int):
        """(scores [B], {part: batch mean}). The reward model scores `render_prompt + render_completion`
        through `scoring.score_texts`, exactly the text the reward stage trained on."""
        texts = [s.text for s in samples]
        scores, parts = torch.zeros(len(samples)), {}
        if self.model is not None:
            rm = torch.tensor(score_texts(self.model, self.tokenizer, [prompt_of(r) for r in rows], texts, batch_size,
                                          finished=[s.finished for s in samples]))
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


class PPOLoop:
    """State of one PPO run; `run()` does the updates. Plain composition, one method per phase."""

    def __init__(self, ctx: StageContext):
        self.ctx, self.cfg, self.t = ctx, ctx.config, ctx.config.train
        report_to = ctx.recipe.report_to
        trackers = [r for r in ([report_to] if isinstance(report_to, str) else report_to) if r != "none"]
        self.acc = Accelerator(log_with=trackers or None, project_dir=str(ctx.out_dir / "logs"),
                               gradient_accumulation_steps=self.t.gradient_accumulation_steps)
        self.engine = check_engine(self.acc.state, ctx.where)
        if self.engine in PARTITIONED and self.cfg.rollout.backend == "vllm":
            raise UserError(f"{ctx.where}.rollout.backend: vllm takes the policy's weights whole for every rollout, "
                            f"which {self.engine} partitions across processes; that is not supported: sample with "
                            "backend: transformers, or run under DDP or ZeRO-2.")
        set_seed(ctx.seed)  # the same fresh adapters/value head on every rank (DDP also broadcasts rank 0's)
        self.tokenizer = ctx.load_tokenizer()
        self.scorer = Scorer(ctx, self.acc.device)
        self.rows, self.prompts = prompt_rows(ctx, self.tokenizer, [r.verifier for r in self.scorer.rewards],
                                              [g.verifier for g in self.scorer.gold])
        self.models = build_models(ctx.start_model, ctx.lora, self.scorer.model, ctx.recipe.trust_remote_code)
        if self.wants_checkpointing():
            self.models.actor_critic.enable_checkpointing()
        if self.models.reference is not None:
            self.models.reference.to(self.acc.device)
        self.ac = self.models.actor_critic.eval()  # eval: no dropout in rollouts or in the PPO ratio
        groups = self.ac.param_groups(self.t.learning_rate, self.t.critic_learning_rate or self.t.learning_rate,
                                      self.t.weight_decay)
        optimizer = torch.optim.AdamW(groups, lr=self.t.learning_rate)
        self.total = self.total_updates()
        self.steps_per_update = self.t.ppo_epochs * (self.cfg.rollout.batch_size // self.t.mini_batch_size)
        # Not passed to `prepare`: accelerate's scheduler wrapper steps once per process.
        self.scheduler = get_scheduler(self.t.lr_scheduler_type, optimizer, num_warmup_steps=self.t.warmup_steps,
                                       num_training_steps=self.total * self.steps_per_update)
        if self.engine.startswith("zero"):
            configure_deepspeed(self.acc, self.micro_batch_size, self.t.gradient_accumulation_steps, self.t.max_grad_norm)
        self.model, self.optimizer = self.acc.prepare(self.ac, optimizer)
        self.kl_ctl = make_kl_controller(self.cfg.kl_coef, self.cfg.kl_target, self.cfg.kl_horizon)
        self.acc.register_for_checkpointing(self.scheduler, self.kl_ctl)
        self.update, self.history, self.reward_stats = 0, [], {"count": 0.0, "mean": 0.0, "m2": 0.0}
        self._orders: dict[int, list[int]] = {}
        stop = self.cfg.early_stop
        self.watch = GoldWatch(gold_key(ctx, self.scorer.gold), stop.window, stop.patience) if stop else None
        self.best_policy: dict | None = None  # the policy state at the watch's best (main process, CPU)
        self.stopped_at: int | None = None

    def wants_checkpointing(self) -> bool:
        """The recipe's `train.gradient_checkpointing`, else the memory estimate for one micro-batch: the
        longest prompt plus `max_new_tokens`, a policy and a critic pass, logits for the completion only."""
        if self.t.gradient_checkpointing is not None:
            return self.t.gradient_checkpointing

        def micro_batch() -> StepShape:
            longest = max(len(encode(self.tokenizer, p)) for p in self.prompts)
            new_tokens = self.cfg.rollout.max_new_tokens
            return StepShape(self.micro_batch_size, longest + new_tokens, reference_copy=self.ctx.lora is None,
                             lora_rank=self.ctx.lora.r if self.ctx.lora else None, critic=True,
                             logit_length=new_tokens)

        return needs_checkpointing(self.ctx.start_model, micro_batch, default_dtype().itemsize,
                                   self.ctx.recipe.trust_remote_code, f"{self.ctx.where}.train")

    def total_updates(self) -> int:
        if self.t.total_updates:
            return self.t.total_updates
        episodes = self.t.total_episodes or len(self.rows)
        return max(1, math.ceil(episodes / (self.cfg.rollout.batch_size * self.acc.num_processes)))

    # -- rollout ------------------------------------------------------------------------------------

    def prompt_indices(self) -> list[int]:
        """This process's prompts for the current update: consecutive slices of seeded permutations,
        one permutation per pass over the data, so any update's prompts follow from its number."""
        n, per = len(self.rows), self.cfg.rollout.batch_size
        start = (self.update * self.acc.num_processes + self.acc.process_index) * per
        picked = []
        for pos in range(start, start + per):
            epoch = pos // n
            if epoch not in self._orders:
                self._orders = {epoch: random.Random(f"{self.ctx.seed}-{epoch}").sample(range(n), n)}
            picked.append(self._orders[epoch][pos % n])
        return picked

    def rollout(self) -> tuple[Rollout, RolloutStats]:
        """Sample, score, and compute old log-probs, reference log-probs, values and entropy."""
        r, started = self.cfg.rollout, time.time()
        indices = self.prompt_indices()
        rows, prompts = [self.rows[i] for i in indices], [self.prompts[i] for i in indices]
        sampling = r if can_merge_lora(self.acc) else r.model_copy(update={"merge_lora": False})
        with gathered(self.acc, self.model) as call:
            samples = call(generate, self.ac.policy, self.tokenizer, prompts, sampling)
        sample_seconds = time.time() - started
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids, attention, mask = prompt_completion_batch([encode(self.tokenizer, p) for p in prompts],
                                                       [s.token_ids for s in samples], pad, self.acc.device)
        scores, parts = self.scorer(rows, samples, self.micro_batch_size)
        k = mask.shape[1]
        chunks = length_chunks(attention, self.micro_batch_size)
        unsort = torch.argsort(torch.cat([rows for rows, _ in chunks]))
        with torch.no_grad():
            outs = [self.ac(ids[rows, start:], attention[rows, start:], k, r.temperature, with_entropy=True)
                    for rows, start in chunks]
            logprobs, values, entropy = (torch.cat(x)[unsort] for x in zip(*outs))
            with gathered(self.acc, self.model) as call:
                ref_logprobs = torch.cat([call(self.models.reference_logprobs, ids[rows, start:],
                                               attention[rows, start:], k, r.temperature)
                                          for rows, start in chunks])[unsort]
        rollout = Rollout(query_responses=ids, attention_mask=attention, response_mask=mask, logprobs=logprobs,
                          ref_logprobs=ref_logprobs, values=values, entropy=entropy, scores=scores.to(self.acc.device),
                          finished=torch.tensor([s.finished for s in samples], device=self.acc.device))
        return rollout, RolloutStats(reward_means=parts, sample_seconds=sample_seconds)

    @property
    def micro_batch_size(self) -> int:
        return self.t.mini_batch_size // self.t.gradient_accumulation_steps

    # -- rewards and advantages ---------------------------------------------------------------------

    def normalise(self, scores):
        """Scores as the reward: raw, or standardised by this batch's (all processes) or running
        statistics (Welford), then clipped to [-reward_clip, reward_clip] if set."""
        norm = self.t.reward_norm
        if norm != "none":
            gathered = self.acc.gather(scores).float()
            if norm == "batch":
                mean, std = gathered.mean(), gathered.std() if len(gathered) > 1 else torch.tensor(1.0)
            else:
                s = self.reward_stats
                for value in gathered.tolist():
                    s["count"] += 1
                    delta = value - s["mean"]
                    s["mean"] += delta / s["count"]
                    s["m2"] += delta * (value - s["mean"])
                mean = torch.tensor(s["mean"])
                std = torch.tensor(math.sqrt(s["m2"] / max(s["count"] - 1, 1)))
            scores = (scores - mean.to(scores.device)) / (std.to(scores.device) + 1e-8)
        if self.t.reward_clip is not None:
            scores = scores.clamp(-self.t.reward_clip, self.t.reward_clip)
        return scores

    def advantages(self, rollout: Rollout) -> tuple[Rollout, dict]:
        """The rollout with GAE advantages and returns of the KL-penalised rewards, and its statistics."""
        mask = rollout.response_mask
        rewards, kl = penalized_rewards(self.normalise(rollout.scores), rollout.logprobs, rollout.ref_logprobs,
                                        mask, self.kl_ctl.value, self.cfg.kl_estimator)
        advantages, returns = gae_advantages(rewards, rollout.values, mask, self.t.gamma, self.t.lam)
        if self.t.whiten_advantages and mask.sum() > 1:
            advantages = masked_whiten(advantages, mask)
        stats = {
            "kl": kl.sum(1).mean().item(), "non_score_reward": (-self.kl_ctl.value * kl).sum(1).mean().item(),
            "entropy": masked_mean(rollout.entropy, mask).item(),
            "explained_variance": explained_variance(rollout.values, returns, mask).item() if mask.sum() > 1 else 0.0,
            "value_mean": masked_mean(rollout.values, mask).item(),
        }
        return dataclasses.replace(rollout, advantages=advantages, returns=returns), stats

    # -- optimisation -------------------------------------------------------------------------------

    def train_on(self, rollout: Rollout) -> dict:
        """`ppo_epochs` passes of shuffled minibatches; returns the mean loss statistics."""
        size, mini, accum = len(rollout), self.t.mini_batch_size, self.t.gradient_accumulation_steps
        totals: dict[str, float] = {}
        count, tokens, norms = 0, 0, []
        for _ in range(self.t.ppo_epochs):
            order = self.minibatch_order(rollout)
            for start in range(0, size, mini):
                rows = order[start:start + mini]
                local_loss = 0.0
                for j in range(accum):
                    micro = rows[j * self.micro_batch_size:(j + 1) * self.micro_batch_size]
                    # accelerate's accumulation: no gradient sync before the last micro-batch (DDP, FSDP2), the
                    # loss divided by `accum` (DeepSpeed divides it itself and steps at the last one)
                    with self.acc.accumulate(self.model):
                        loss, stats, n_tokens = self.micro_loss(rollout[micro.to(rollout.device)].trimmed())
                        self.acc.backward(loss)
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
        (`buckets.bucketed_order`). Each minibatch then trims to its own longest row (`Rollout.trimmed`): in the
        quickstart, where one prompt in ten is twice as long, 3 of every 4 minibatches stop paying for them."""
        if self.t.train_sampling_strategy == "random":
            return torch.randperm(len(rollout))
        return bucketed_order(rollout.attention_mask.sum(1).tolist(), self.t.mini_batch_size)

    def micro_loss(self, micro: Rollout):
        """Clipped policy loss + vf_coef * clipped value loss on a micro-batch, both masked by its
        `response_mask`; its statistics and its number of tokens."""
        logprobs, values, _ = self.model(micro.query_responses, micro.attention_mask, micro.response_width,
                                         self.cfg.rollout.temperature)
        pg, pg_stats = policy_loss(logprobs, micro.logprobs, micro.advantages, micro.response_mask, self.t.cliprange)
        vf, vf_stats = value_loss(values, micro.values, micro.returns, micro.response_mask, self.t.cliprange_value)
        stats = {"policy_loss": pg.item(), "value_loss": vf.item()}
        stats.update({name: value.item() for name, value in {**pg_stats, **vf_stats}.items()})
        return pg + self.t.vf_coef * vf, stats, int(micro.attention_mask.sum().item())

    def step(self, local_loss: float) -> float:
        """Clip, check, step. A non-finite loss or gradient on any process stops every process before
        the optimizer step, so the weights and the last checkpoint stay intact. (DeepSpeed clips and steps
        inside the last micro-batch's backward pass; there the stop comes after its step, and the last
        checkpoint stays intact.)"""
        norm = self.acc.clip_grad_norm_(self.model.parameters(), self.t.max_grad_norm or float("inf"))
        norm = float(norm)
        bad = torch.tensor(0.0 if math.isfinite(local_loss) and math.isfinite(norm) else 1.0, device=self.acc.device)
        if self.acc.reduce(bad, reduction="sum").item() > 0:
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

    # -- one update, metrics ------------------------------------------------------------------------

    def one_update(self) -> dict | None:
        """One rollout and its training; None when `early_stop` ends the run at this rollout (not trained on)."""
        set_seed((self.ctx.seed * 1_000_003 + self.update * 1_009 + self.acc.process_index) % 2**32)
        rollout, rollout_stats = self.rollout()
        if self.watch is not None and self.watch_gold(rollout_stats):
            return None
        rollout, stats = self.advantages(rollout)
        started = time.time()
        stats.update(self.train_on(rollout))
        train_time = time.time() - started
        entry = self.metrics(rollout, rollout_stats, stats, train_time)
        self.kl_ctl.update(entry["kl"], self.cfg.rollout.batch_size * self.acc.num_processes)
        return entry

    def watch_gold(self, rollout_stats: RolloutStats) -> bool:
        """`early_stop`: record this rollout's gold mean (over all processes); on a new best window average keep a
        copy of the policy that sampled it; True once `patience` updates have passed without one."""
        local = torch.tensor(float(rollout_stats.reward_means[self.watch.key]), device=self.acc.device)
        update = self.update + 1
        if self.watch.observe(update, self.acc.reduce(local, "mean").item()):
            self.best_policy = self.policy_copy()
        if not self.watch.exhausted(update):
            return False
        self.stopped_at = update
        log.info(f"[{self.ctx.stage_id}] early stop at update {update}: the {self.watch.key} average over "
                 f"{self.watch.window} updates has not passed {self.watch.best:.4g} (update {self.watch.best_update}) "
                 f"for {update - self.watch.best_update} updates; this rollout is not trained on")
        return True

    def policy_copy(self) -> dict | None:
        """The policy's gathered state, copied to CPU on the main process (every process takes part in the
        gather; the others get None)."""
        state = self.acc.get_state_dict(self.model)
        if not self.acc.is_main_process:
            return None
        _, policy = policy_state(self.acc.unwrap_model(self.model), state)
        return {k: v.detach().to("cpu", copy=True) for k, v in policy.items()}

    def metrics(self, rollout: Rollout, rollout_stats: RolloutStats, stats: dict, train_time: float) -> dict:
        """Per-update metrics averaged over processes (scores over the gathered batch)."""
        scores = self.acc.gather(rollout.scores.float())
        lengths = rollout.response_mask.sum(1)
        local = {**rollout_stats.reward_means, **{k: v for k, v in stats.items() if k != "train_tokens"},
                 "response_length": lengths.mean().item(), "eos_fraction": rollout.finished.float().mean().item()}
        names = sorted(local)
        means = self.acc.reduce(torch.tensor([float(local[n]) for n in names], device=self.acc.device), "mean")
        sums = self.acc.reduce(torch.tensor([lengths.sum().item(), float(stats["train_tokens"])],
                                            device=self.acc.device), "sum")
        entry = {"update": self.update + 1, "episodes": (self.update + 1) * len(scores),
                 "score": scores.mean().item(), "score_std": scores.std().item() if len(scores) > 1 else 0.0,
                 **{n: v for n, v in zip(names, means.tolist())}, "kl_coef": self.kl_ctl.value,
                 "learning_rate": self.scheduler.get_last_lr()[0],
                 "rollout_tokens_per_s": sums[0].item() / max(rollout_stats.sample_seconds, 1e-9),
                 "train_tokens_per_s": sums[1].item() / max(train_time, 1e-9)}
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in entry.items()}

    def run(self) -> dict:
        self.resume()
        if self.acc.trackers:
            self.acc.init_trackers(f"{self.ctx.recipe.name}-{self.ctx.stage_id}")
        for _ in track(range(self.update, self.total), description=f"{self.ctx.stage_id} (ppo)",
                       total=self.total - self.update):
            entry = self.one_update()
            if entry is None:
                break
            self.history.append(entry)
            self.update += 1
            self.acc.log(entry, step=self.update)
            if self.update % self.t.logging_steps == 0 or self.update == self.total:
                keys = [*LOG_KEYS, *(k for k in entry if k.startswith("gold/"))]
                shown = " ".join(f"{k}={entry[k]:.4g}" for k in keys if k in entry)
                log.info(f"[{self.ctx.stage_id}] {shown} ({self.update}/{self.total})")
            if self.update % self.t.save_every == 0 and self.update < self.total:
                self.save_state()
        for tracker in self.acc.trackers:  # not `end_training()`: it destroys the process group the runner still uses
            tracker.finish()
        self.save_final()
        metrics = dict(self.history[-1]) if self.history else {}
        metrics.update(updates=self.update, prompts=len(self.rows),
                       start_score=self.history[0]["score"] if self.history else None)
        if self.watch is not None:
            metrics.update({"early_stop/best_update": self.watch.best_update or None,
                            "early_stop/best_gold": self.watch.best if self.watch.best_update else None,
                            "early_stop/stopped_at": self.stopped_at})
        return {"metrics": metrics, "log_history": self.history}

    # -- checkpoints --------------------------------------------------------------------------------

    def save_final(self) -> None:
        """The trained policy as the stage's checkpoint (merged weights + adapter): gathered from every
        process, written by rank 0 (`sharding.save_trained`)."""
        self.acc.wait_for_everyone()
        pick = policy_state
        if self.watch is not None and self.watch.best_update:  # the same on every process (reduced gold means)
            log.info(f"[{self.ctx.stage_id}] saving the policy that sampled update {self.watch.best_update}'s rollouts "
                     f"(best {self.watch.key} average {self.watch.best:.4g}), not the last one")
            pick = self.kept_policy
        save_trained(self.acc, self.model, self.tokenizer, self.ctx.out_dir, self.ctx.save_dtype(), pick=pick)

    def kept_policy(self, actor_critic, _gathered: dict) -> tuple:
        """`save_trained`'s pick under `early_stop`: the policy module, with the state kept at the best."""
        return actor_critic.policy, self.best_policy

    def save_state(self) -> None:
        state = {"update": self.update, "reward_stats": self.reward_stats, "log_history": self.history}
        files = {}
        if self.watch is not None:
            state["early_stop"] = self.watch.state()
            files = {BEST_POLICY: self.best_policy} if self.best_policy is not None else {}
        save_loop_state(self.acc, Path(self.ctx.work_dir), self.update, state, files)

    def resume(self) -> None:
        state, path = load_loop_state(self.acc, Path(self.ctx.work_dir))
        if state is not None:
            self.update, self.history, self.reward_stats = state["update"], state["log_history"], state["reward_stats"]
            if self.watch is not None and "early_stop" in state:
                self.watch.restore(state["early_stop"])
                if self.watch.best_update and self.acc.is_main_process:
                    self.best_policy = torch.load(path / BEST_POLICY, weights_only=True)
            log.info(f"[{self.ctx.stage_id}] resuming from update {self.update} ({path})")


BEST_POLICY = "best_policy.pt"  # early_stop's kept policy state, in a loop checkpoint


def gold_key(ctx: StageContext, gold: list) -> str:
    """The logged name of the gold verifier `early_stop.gold` watches."""
    names = [g.__name__ for g in gold]
    key = f"gold/{ctx.config.early_stop.gold}"
    if key not in names:
        raise UserError(f"{ctx.where}.early_stop.gold: '{ctx.config.early_stop.gold}' is logged under another name; "
                        f"the gold verifiers are logged as {', '.join(names)}: name one of those (without gold/).")
    return key


LOG_KEYS = ["score", "rm_score", "kl", "kl_coef", "entropy", "policy_loss", "value_loss", "clipfrac", "approx_kl",
            "explained_variance", "response_length", "eos_fraction"]


# ---------------------------------------------------------------------------------------------------
# Stage entry points
# ---------------------------------------------------------------------------------------------------


def check(ctx: StageContext) -> None:
    tokenizer = ctx.load_tokenizer()
    prompt_rows(ctx, tokenizer, resolve_all(ctx.config.verifiers, [ctx.recipe.base_dir], ctx.where),
                resolve_all(ctx.config.gold, [ctx.recipe.base_dir], ctx.where, entry="gold"))
    if ctx.config.early_stop is not None:
        gold_key(ctx, build_gold(ctx.config.gold, [ctx.recipe.base_dir], ctx.where))
    ref = ctx.config.reward_model
    if ref is not None:
        check_reward_model(ref, ctx.resolve_model(ref), f"{ctx.where}.reward_model", ctx.recipe.trust_remote_code)


def run(ctx: StageContext) -> dict:
    return PPOLoop(ctx).run()
