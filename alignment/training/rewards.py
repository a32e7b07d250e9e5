"""Verifiers as rewards: TRL reward functions, and the resolving/column checks of an RL stage's `verifiers:` list.

TRL's GRPOTrainer / RLOOTrainer call each reward function as
``f(prompts=[...], completions=[...], completion_ids=[...], trainer_state=..., log_metric=..., **columns)``
where every dataset column arrives as a list (one value per completion). `VerifierReward` adapts a
resolved `Verifier` to that call: one example dict per completion (the row's columns, `prompt` as written
in the data), scored with `Verifier.score`. It never raises for a bad completion: a row the verifier
raises on scores 0.0 (status "error") and is counted, so training goes on. Besides TRL's own
``rewards/<name>/mean`` it logs ``unparseable/<name>`` and ``errors/<name>`` per logging step, and running
totals from `counts` in the stage's final metrics.

    rewards = build_rewards([VerifierSpec(name="arithmetic")], search_dirs=[recipe_dir])
    GRPOTrainer(..., reward_funcs=rewards, args=GRPOConfig(reward_weights=[r.weight for r in rewards]))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from accelerate.utils import gather_object

from ..config.verifier import VerifierSpec
from ..errors import UserError
from ..runtime.dist import get_logger, log_share
from ..verifiers import VerifyResult, is_pass, resolve
from .scoring import score_texts
from .signal import SPREAD_EPS

log = get_logger(__name__)


# The dataset column holding the prompt as written in the data; the `prompt` column TRL sees is rendered text.
SOURCE_PROMPT = "source_prompt"
# Keyword arguments TRL adds to every reward call that are not dataset columns.
TRL_EXTRAS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


def resolve_all(specs: Iterable[VerifierSpec], search_dirs: list[Path], where: str, entry: str = "verifiers") -> list:
    """Resolve each spec to a `Verifier`; errors name the entry (`stages.x.verifiers.1`, `stages.x.gold.0`)."""
    resolved = []
    for index, spec in enumerate(specs):
        try:
            resolved.append(resolve(spec.name, options=spec.options, search_dirs=search_dirs))
        except UserError as error:
            raise UserError(f"{where}.{entry}.{index}: {error}") from None
    return resolved


def check_verifier_columns(
    verifiers: list,
    columns: Iterable[str],
    where: str,
    provided: Iterable[str] = ("prompt",),
    entry: str | None = "verifiers",
) -> None:
    """Fail before training when the data at `where` lacks a column a verifier needs (e.g. `answer`).
    `provided`: columns the caller fills in itself (the RL stages hand every verifier the row's prompt);
    `entry`: the recipe list the verifiers came from, named in the message with the index."""
    present = set(columns) | set(provided)
    for index, verifier in enumerate(verifiers):
        missing = [c for c in verifier.required_columns if c not in present]
        if missing:
            label = f" ({entry}.{index})" if entry else ""
            raise UserError(
                f"{where}: verifier '{verifier.name}'{label} needs column(s) {', '.join(map(repr, missing))}, "
                f"which the data lacks; columns present: {', '.join(sorted(columns))}. Use "
                "'rename: {old: new}' in the data spec to map a column."
            )


class VerifierReward:
    """A TRL reward function wrapping one `Verifier` (see module docstring)."""

    def __init__(self, verifier, weight: float = 1.0, label: str | None = None):
        self.verifier = verifier
        self.weight = weight
        # TRL logs `rewards/<__name__>/mean`; the recipe's name makes that line findable.
        self.__name__ = label or verifier.name
        self.counts: Counter = Counter()
        self._warned = False
        self.signal: GroupSignal | None = None  # set by GroupSignal: it sees every reward this function gives

    def __call__(self, prompts=None, completions=None, **kwargs) -> list[float]:
        columns = {k: v for k, v in kwargs.items() if k not in TRL_EXTRAS}
        completions = list(completions or [])
        examples = [self._example(columns, i, prompts) for i in range(len(completions))]
        results = self.score(completions, examples)
        log_metric, n = kwargs.get("log_metric"), max(len(results), 1)
        if callable(log_metric):
            log_metric(f"unparseable/{self.__name__}", sum(r.status == "unparseable" for r in results) / n)
            log_metric(f"errors/{self.__name__}", sum(r.status == "error" for r in results) / n)
        rewards = [float(r.reward) for r in results]
        if self.signal is not None:
            self.signal.record(self, rewards, kwargs.get("completion_ids"), log_metric)
        return rewards

    def score(self, completions: list, examples: list[dict]) -> list:
        """VerifyResults for completions[i] against examples[i]; counted in `counts`; never raises for a row."""
        try:
            results = self.verifier.score_batch(completions, examples)  # threads for sandboxed verifiers
        except UserError:
            raise  # a data/recipe mistake (a missing column), not a bad completion
        except Exception:  # noqa: BLE001 - fall back to row by row, so one bad row costs only itself
            results = [self._score_one(c, e) for c, e in zip(completions, examples)]
        for result in results:
            self.counts[result.status] += 1
        self.counts["total"] += len(results)
        errors = [r for r in results if r.status == "error"]
        if errors and not self._warned:
            self._warned = True
            log.info(
                f"[verifier {self.__name__}] a completion could not be scored and gets reward 0 "
                f"({errors[0].detail}); further errors are counted in errors/{self.__name__}."
            )
        return results

    @staticmethod
    def _example(columns: dict[str, list], index: int, prompts) -> dict:
        example = {k: v[index] for k, v in columns.items()}
        source = example.pop(SOURCE_PROMPT, None)
        if source is not None:
            example["prompt"] = source
        elif prompts is not None:
            example["prompt"] = prompts[index]
        return example

    def _score_one(self, completion, example):
        # Verifier.score already turns an exception in the user's function into an "error" row; this
        # second guard covers everything around it, so a verifier can never stop a training run.
        try:
            return self.verifier.score(completion, example)
        except UserError:
            raise
        except Exception as error:  # noqa: BLE001
            return VerifyResult(0.0, "error", f"{type(error).__name__}: {error}"[:2000])

    def totals(self) -> dict[str, float]:
        """Running totals for the stage's metrics."""
        total = self.counts["total"]
        return {
            f"verifier/{self.__name__}/scored": total,
            f"verifier/{self.__name__}/errors": self.counts["error"],
            f"verifier/{self.__name__}/unparseable": self.counts["unparseable"],
            f"verifier/{self.__name__}/error_rate": self.counts["error"] / total if total else 0.0,
        }


class GoldReward(VerifierReward):
    """A gold verifier (`gold:`): scored on every rollout and logged as `gold/<name>`, never part of the reward.
    Its weight is 0 whatever the recipe says; the RL stages leave it out of the reward they optimise (rlvr hands
    it to TRL as a reward function of weight 0, so TRL scores and logs it along with the others and its column
    adds 0 to the weighted sum). The true objective in view while a proxy is optimised (Gao et al. 2022)."""

    def __call__(self, prompts=None, completions=None, **kwargs) -> list[float]:
        rewards = super().__call__(prompts, completions, **kwargs)
        if callable(log_metric := kwargs.get("log_metric")):
            log_metric(self.__name__, sum(rewards) / max(len(rewards), 1))
        return rewards


def build_rewards(specs: list[VerifierSpec], search_dirs: list[Path], where: str = "stage") -> list[VerifierReward]:
    """One `VerifierReward` per spec; duplicate names get a '#2' suffix so their logs stay apart."""
    return _labelled(VerifierReward, specs, resolve_all(specs, search_dirs, where), "")


def build_gold(specs: list[VerifierSpec], search_dirs: list[Path], where: str = "stage") -> list[GoldReward]:
    """One `GoldReward` per `gold:` spec, named `gold/<name>` (duplicates '#2'), weight 0."""
    return _labelled(GoldReward, specs, resolve_all(specs, search_dirs, where, entry="gold"), "gold/", weight=0.0)


def _labelled(kind, specs: list[VerifierSpec], verifiers: list, prefix: str, weight: float | None = None) -> list:
    seen: Counter = Counter()
    rewards = []
    for spec, verifier in zip(specs, verifiers):
        seen[verifier.name] += 1
        label = verifier.name if seen[verifier.name] == 1 else f"{verifier.name}#{seen[verifier.name]}"
        rewards.append(kind(verifier, spec.weight if weight is None else weight, prefix + label))
    return rewards


def gold_means(gold: list[GoldReward], completions: list[str], examples: list[dict]) -> dict[str, float]:
    """{`gold/<name>`: mean reward over the completions}: what ppo and rsft log for their `gold:` verifiers."""
    n = max(len(completions), 1)
    return {g.__name__: sum(r.reward for r in g.score(completions, examples)) / n for g in gold}


class RewardModelReward:
    """A reward model as a TRL reward function: the score of `render_prompt(p) + render_completion(p, c)`
    through `scoring.score_texts`, exactly as ppo and rsft score (and the reward stage trained on); a completion
    cut at max_completion_length (its last id is no stop token) is scored as sampled, without an end-of-turn
    token. `p` is the prompt as written in the data (SOURCE_PROMPT). RLOO with a reward model is RLHF without
    a critic (Ahmadian et al. 2024). TRL's own reward-model path would score `prompt + completion` tokenized
    whole with no end-of-turn token, a text the reward model never saw in training."""

    def __init__(
        self,
        model,
        tokenizer,
        stop_ids: Iterable[int],
        weight: float = 1.0,
        batch_size: int = 16,
        label: str = "reward_model",
    ):
        self.model, self.tokenizer, self.stop_ids = model, tokenizer, set(stop_ids)
        self.weight, self.batch_size, self.__name__ = weight, batch_size, label
        self.signal: GroupSignal | None = None

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float]:
        sources = kwargs.get(SOURCE_PROMPT) or prompts
        completions = list(completions or [])
        finished = (
            None if completion_ids is None else [bool(ids) and ids[-1] in self.stop_ids for ids in completion_ids]
        )
        rewards = score_texts(self.model, self.tokenizer, list(sources), completions, self.batch_size, finished)
        if self.signal is not None:
            self.signal.record(self, rewards, completion_ids, kwargs.get("log_metric"))
        return rewards


def combined_scores(rewards: list[VerifierReward], completions: list[str], examples: list[dict]) -> list[dict]:
    """Per completion: `score` (weighted reward sum), `parsed` (no verifier found it unparseable or failed)
    and `passed` (every verifier passed it). RSFT's filter reads these."""
    per_reward = [reward.score(completions, examples) for reward in rewards]
    return [
        {
            "score": sum(r.weight * results[i].reward for r, results in zip(rewards, per_reward)),
            "parsed": all(results[i].status == "ok" for results in per_reward),
            "passed": all(is_pass(results[i]) for results in per_reward),
        }
        for i in range(len(completions))
    ]


# Above this share of prompt groups without reward variance, most of the run had no verifier signal.
ZERO_VARIANCE_WARNING = 0.5


class GroupSignal:
    """What the verifiers' rewards teach GRPO/RLOO, counted from those rewards themselves, per generation batch:
    prompt groups whose completions all got the same total reward (weighted sum over `rewards`), and
    completions cut at max_completion_length (the last sampled id is no stop token: TRL's own test).

    Such a group's advantages are all 0 (GRPO: r - mean over std; RLOO: r minus the leave-one-out mean), so
    it adds nothing but the KL term to the gradient. TRL's `frac_reward_zero_std` cannot tell: RLOO computes it
    after subtracting the KL penalty (with `beta > 0` it reads near 0 when the verifiers gave equal rewards),
    GRPO under `scale_rewards: batch` from the batch's spread. TRL calls the reward functions in order on every
    process with that process's slice of the batch, whose groups (`num_generations` consecutive completions of
    one prompt) may span processes: the last function's call gathers the slices, in process order as TRL does.
    Counted for training batches (`training()` true, the trainer's model in train mode); every batch logs its
    shares (`signal/...`, eval's with TRL's `eval_` prefix)."""

    def __init__(
        self,
        rewards: list,
        stop_ids: Iterable[int],
        num_generations: int,
        num_generations_eval: int | None = None,
        training: Callable[[], bool] = lambda: True,
    ):
        self.rewards, self.stop_ids = rewards, set(stop_ids)
        self.sizes = (num_generations, num_generations_eval or num_generations)
        self.training = training
        self.pending: dict[str, list[float]] = {}
        self.counts: Counter = Counter()
        self.last_flat: list[bool] | None = None  # the last batch's groups (every process's): no reward spread
        for reward in rewards:
            reward.signal = self

    def record(self, reward, values: list[float], completion_ids, log_metric=None) -> None:
        self.pending[reward.__name__] = values
        if len(self.pending) < len(self.rewards):
            return
        totals = [sum(r.weight * self.pending[r.__name__][i] for r in self.rewards) for i in range(len(values))]
        self.pending = {}
        cut = [bool(ids) and ids[-1] not in self.stop_ids for ids in completion_ids or [[]] * len(totals)]
        batch = gather_object(list(zip(totals, cut)))
        size = self.sizes[0] if self.training() else self.sizes[1]
        groups = [[total for total, _ in batch[i : i + size]] for i in range(0, len(batch), size)]
        self.last_flat = [max(g) - min(g) <= SPREAD_EPS for g in groups]  # dynamic sampling reads it
        flat = sum(self.last_flat)
        truncated = sum(c for _, c in batch)
        if self.training():
            self.counts.update(groups=len(groups), zero_variance=flat, completions=len(batch), truncated=truncated)
        if callable(log_metric):
            log_metric("signal/zero_variance_groups", flat / max(len(groups), 1))
            log_metric("signal/completions_truncated", truncated / max(len(batch), 1))

    def metrics(self) -> dict[str, float]:
        """For stage.json: the run's share of groups without reward variance, and the cut completions."""
        if not self.counts["groups"]:
            return {}
        return {
            "zero_variance_groups": self.counts["zero_variance"] / self.counts["groups"],
            "completions_truncated": self.counts["truncated"],
            "completions_sampled": self.counts["completions"],
        }

    def report(self, where: str, max_completion_length: int | None, masked: bool = False) -> None:
        """Say what the counts mean: a warning when most groups taught nothing or many answers were cut. `masked`:
        the run set `mask_truncated_completions`, so the cut completions were left out of the loss (TRL zeroes
        their completion mask); their rewards still count in their group's baseline."""
        found = self.metrics()
        if not found:
            return
        if found["zero_variance_groups"] > ZERO_VARIANCE_WARNING:
            log.warning(
                f"[{where}] {found['zero_variance_groups']:.0%} of prompt groups got the same reward for every one of "
                "their completions (zero_variance_groups in stage.json): those groups give GRPO/RLOO no gradient, so "
                "the policy barely moved. Give prompts the policy solves some of the time (harder ones if it solves "
                "them all, easier if none), sample more diversely (a higher train.temperature), or raise "
                "train.num_generations."
            )
        cut, total = found["completions_truncated"], found["completions_sampled"]
        if not cut:
            return
        if masked:
            what = (
                "they were scored, and their rewards count in their group's baseline, but they were left out of "
                "the loss (mask_truncated_completions: true), so their samples taught nothing. Raise "
                "train.max_completion_length to waste fewer."
            )
        else:
            what = (
                "they were scored and trained as cut off, without an end-of-turn token. Raise "
                "train.max_completion_length, or set train.mask_truncated_completions: true to leave them out "
                "of the loss."
            )
        log_share(
            log,
            cut,
            total,
            f"[{where}] {cut} of {total} completions ({cut / total:.0%}) were cut at "
            f"max_completion_length={max_completion_length} tokens before their end-of-turn token "
            f"(completions_truncated in stage.json); {what}",
        )
