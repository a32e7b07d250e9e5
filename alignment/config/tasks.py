"""The parameters of the built-in tasks (`data: {task: NAME, ...}`): validated here, torch-free and without
importing the task, so loading a recipe stays in the config layer; the task modules in `alignment/tasks/`
build the rows from them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ..errors import UserError
from .base import Strict, did_you_mean


class SplitBands(Strict):
    """The test and validation bands of the generated tasks (alignment/tasks/splits.py)."""

    test_fraction: float = Field(
        0.1,
        gt=0,
        lt=1,
        description="share of all problems (by a hash of the problem's text; for reasoning_gym, of each task's "
        "questions) reserved for the test split",
    )
    validation_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="share of all problems (by a hash of the problem's text) reserved for the `validation` split, "
        "disjoint from the test and training problems: settings chosen on it are chosen on problems the test split "
        "never scores; 0: no validation split (the training problems are then those outside the test share)",
    )

    @model_validator(mode="after")
    def _bands_leave_training_problems(self):
        if self.test_fraction + self.validation_fraction >= 1:
            raise ValueError(
                f"test_fraction {self.test_fraction} + validation_fraction {self.validation_fraction} leave no "
                "training problems: their sum must be below 1"
            )
        return self


class ArithmeticParams(SplitBands):
    """Keys of `data: {task: arithmetic, ...}` (alignment/tasks/arithmetic.py builds the rows)."""

    n: int = Field(1000, gt=0, description="number of rows")
    digits: int | tuple[int, int] = Field(2, description="digits per operand, or a (min, max) range")
    operators: list[Literal["+", "-", "*"]] = Field(
        default_factory=lambda: ["+"], description="operators a problem draws from, one chosen uniformly per problem"
    )
    format: Literal["prompt_completion", "messages"] = Field(
        "prompt_completion",
        description="prompt_completion: "
        "`prompt` and `completion` columns; messages: a chat "
        "`messages` column instead (both with answer, chosen, "
        "rejected)",
    )
    style: Literal["plain", "sycophancy"] = Field(
        "plain",
        description="sycophancy: every prompt first states a "
        "plausible wrong answer as the user's belief ('I think 37+48 is 75.')",
    )
    phrasing: Literal["compact", "chat"] = Field(
        "compact", description="compact: 'What is 37+48?'; chat: 'What is 37 + 48? Answer with just the number.'"
    )
    sycophancy_fraction: float = Field(
        0.0, ge=0, le=1, description="share of plain-style rows asked the sycophancy way"
    )
    carry_mistake_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of carrying additions whose demonstrated "
        "completion drops the carry (answer, chosen and the verifier stay correct)",
    )


class ToolArithmeticParams(SplitBands):
    """Keys of `data: {task: tool_arithmetic, ...}` (alignment/tasks/tool_arithmetic.py builds the rows):
    products too long to multiply by heart, demonstrated with and without a calculator call."""

    n: int = Field(1000, gt=0, description="number of problems")
    digits: tuple[int, int] = Field((3, 2), description="digits of the two factors")
    demonstrations: bool = Field(
        False,
        description="rows hold conversational `prompt`/`completion` pairs demonstrating "
        "one turn each, the call or direct answer and the answer after a result (SFT); "
        "false: `prompt` and `answer` only (RL, evaluation)",
    )
    call_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="share of demonstrated problems whose first turn calls "
        "the calculator (the others answer directly); every problem also demonstrates the "
        "answer after the calculator's result",
    )
    phrasing: Literal["compact", "chat"] = Field(
        "compact", description="compact: 'What is 123*45?'; chat: 'What is 123 * 45? Answer with just the number.'"
    )


# reasoning-gym's instructions to answer inside <answer></answer> tags (reasoning_gym.utils.SYSTEM_PROMPTS), by
# name: listed here so that a recipe loads without importing reasoning-gym; `none` leaves the prompt bare.
REASONING_GYM_PROMPTS = ("default", "direct", "simple", "DeepSeekZero", "chain_of_draft", "none")


class ReasoningGymTask(Strict):
    """One task of a `reasoning_gym` mix, given as a mapping: its weight and its reasoning-gym config."""

    weight: float = Field(1.0, gt=0, description="the task's share of the rows, relative to the other tasks' weights")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of the task's reasoning-gym "
        "config dataclass (leg_counting: `min_animals`, ...), checked by `align check`; "
        "`seed` and `size` are the toolkit's",
    )

    @model_validator(mode="after")
    def _seed_and_size_are_ours(self):
        taken = [key for key in ("seed", "size") if key in self.config]
        if taken:
            raise ValueError(f"config key(s) {', '.join(taken)}: set from the recipe's seed and `n`, not per task")
        return self


class ReasoningGymParams(SplitBands):
    """Keys of `data: {task: reasoning_gym, ...}` (alignment/tasks/reasoning_gym.py builds the rows): problems
    from reasoning-gym's generators, one task or a weighted mix. Needs `pip install -e ".[tasks]"`."""

    tasks: dict[str, ReasoningGymTask] = Field(
        min_length=1,
        description="reasoning-gym task names, each with its "
        "weight (`leg_counting: 1`) or `{weight, config}`; names are checked "
        "against the installed reasoning-gym by `align check` (importing it "
        "takes seconds, so not at recipe load)",
    )
    n: int = Field(1000, gt=0, description="number of rows, shared among the tasks in proportion to their weights")
    format: Literal["prompt_completion", "messages"] = Field(
        "prompt_completion",
        description="prompt_completion: "
        "`prompt` (instruction and question as one text) and "
        "`completion` columns; messages: a chat `messages` "
        "column instead (the instruction as the system turn)",
    )
    system_prompt: Literal[REASONING_GYM_PROMPTS] = Field(
        "default",
        description="reasoning-gym's instruction to "
        "answer inside <answer></answer> tags, by its name in "
        "reasoning_gym.utils.SYSTEM_PROMPTS; none: the question "
        "alone",
    )

    @field_validator("tasks", mode="before")
    @classmethod
    def _bare_weights(cls, value):
        """`leg_counting: 2` is short for `leg_counting: {weight: 2}`."""
        if isinstance(value, dict):
            return {
                name: {"weight": v} if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                for name, v in value.items()
            }
        return value


TASK_PARAMS: dict[str, type[Strict]] = {
    "arithmetic": ArithmeticParams,
    "tool_arithmetic": ToolArithmeticParams,
    "reasoning_gym": ReasoningGymParams,
}


def task_params_model(name: str) -> type[Strict]:
    """The parameter model of a built-in task; an unknown name is a UserError with a "did you mean"."""
    if name not in TASK_PARAMS:
        raise UserError(
            f"Unknown task '{name}'{did_you_mean(name, TASK_PARAMS)}; built-in tasks: {', '.join(TASK_PARAMS)}."
        )
    return TASK_PARAMS[name]
