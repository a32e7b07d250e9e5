"""Table-driven tests for the format verifiers: regex, think_format, answer_tag, json."""

import pytest

from alignment.errors import UserError
from alignment.verifiers import resolve
from alignment.verifiers.formats import answer_tag, regex, think_format
from alignment.verifiers.json_format import verify as json_verify

REGEX_CASES = [
    ("Answer: 42", {"pattern": r"Answer: \d+"}, 1.0),
    ("The Answer: 42 it is", {"pattern": r"Answer: \d+"}, 1.0),  # search anywhere
    ("The Answer: 42 it is", {"pattern": r"Answer: \d+", "fullmatch": True}, 0.0),
    ("answer: 42", {"pattern": r"Answer: \d+"}, 0.0),
    ("answer: 42", {"pattern": r"Answer: \d+", "flags": "i"}, 1.0),
    ("line\nAnswer: 7", {"pattern": r"^Answer: \d+$", "flags": "m"}, 1.0),
    ("", {"pattern": r"."}, 0.0),
]


@pytest.mark.parametrize(("completion", "options", "expected"), REGEX_CASES)
def test_regex_table(completion, options, expected):
    assert regex(completion, **options) == expected


def test_regex_options_are_checked_at_resolve():
    with pytest.raises(UserError, match="needs the option"):
        resolve("regex")
    with pytest.raises(UserError, match="not a valid regular expression"):
        resolve("regex", options={"pattern": "("})
    with pytest.raises(UserError, match="flags"):
        resolve("regex", options={"pattern": "a", "flags": "q"})
    assert resolve("regex", options={"pattern": "a"}).score("cat", {"answer": "x"}).reward == 1.0


THINK_CASES = [
    ("<think>2+2 is 4</think>The answer is 4.", {}, 1.0),
    ("  \n<think>\nreasoning\n</think>\n\n4", {}, 1.0),  # leading whitespace is fine
    ("The answer is 4.", {}, 0.0),  # missing block
    ("<think>reasoning</think>", {}, 0.0),  # no answer after the block
    ("<think>reasoning</think>   \n", {}, 0.0),
    ("<think></think>4", {}, 0.0),  # empty reasoning
    ("<think>a</think>b<think>c</think>d", {}, 0.0),  # two blocks
    ("Sure! <think>a</think>4", {}, 0.0),  # text before the block
    ("<think>unclosed reasoning 4", {}, 0.0),
    ("4 </think>", {}, 0.0),  # only a closing tag
    ("reasoning</think>4", {"prefilled": True}, 1.0),  # <think> was in the prompt
    ("<think>reasoning</think>4", {"prefilled": True}, 0.0),
    ("", {}, 0.0),
]


@pytest.mark.parametrize(("completion", "options", "expected"), THINK_CASES)
def test_think_format_table(completion, options, expected):
    assert think_format(completion, **options) == expected


ANSWER_CASES = [
    ("<think>...</think><answer>42</answer>", "42", 1.0),
    ("<answer> 42 </answer>", 42, 1.0),
    ("<answer>42.0</answer>", "#### 42", 1.0),  # numeric equality, GSM8K gold
    ("<answer>1,000</answer>", 1000, 1.0),
    ("<answer>41</answer>", "42", 0.0),
    ("<answer>Paris</answer>", "paris", 1.0),  # case-folded
    ("<answer>New   York\n</answer>", "new york", 1.0),  # whitespace collapsed
    ("<answer>Lyon</answer>", "Paris", 0.0),
    ("<answer>1</answer> oops <answer>2</answer>", "2", 1.0),  # the last tag counts
    ("<ANSWER>yes</ANSWER>", "yes", 1.0),
    ("<answer>3 apples</answer>", "3 pears", 0.0),
    ("The answer is 42", "42", None),  # no tag
    ("<answer>42", "42", None),  # unclosed tag
    ("", "42", None),
]


@pytest.mark.parametrize(("completion", "answer", "expected"), ANSWER_CASES)
def test_answer_tag_table(completion, answer, expected):
    assert answer_tag(completion, answer) == expected


def test_answer_tag_case_sensitive_option():
    v = resolve("answer_tag", options={"case_sensitive": True})
    assert v.score("<answer>Paris</answer>", {"answer": "paris"}).reward == 0.0


JSON_CASES = [
    ('{"name": "Ada", "age": 36}', {}, 1.0),
    ('  {"name": "Ada"}\n', {"required_keys": ["name"]}, 1.0),
    ('{"name": "Ada"}', {"required_keys": ["name", "age"]}, 0.0),  # missing key
    ('```json\n{"a": 1}\n```', {}, 1.0),  # fenced
    ('Sure:\n```\n{"a": 1}\n```\nDone.', {}, 1.0),
    ('Here it is: {"a": 1}', {}, 0.0),  # surrounding text without extract
    ('Here it is: {"a": 1} ok?', {"extract": True}, 1.0),
    ("{'a': 1}", {}, 0.0),  # attempted, invalid JSON
    ('{"a": 1,}', {}, 0.0),
    ('[{"a": 1}]', {}, 0.0),  # valid JSON, not an object
    ("[" * 100000 + "{" + "]" * 100000, {}, 0.0),  # absurd nesting is just invalid
    ("no json at all", {}, None),
    ("[1, 2, 3]", {}, None),  # no '{': no object attempted
    ("", {}, None),
]


@pytest.mark.parametrize(("completion", "options", "expected"), JSON_CASES, ids=range(len(JSON_CASES)))
def test_json_table(completion, options, expected):
    assert json_verify(completion, **options) == expected


def test_json_required_keys_option_is_checked():
    with pytest.raises(UserError, match="required_keys"):
        resolve("json", options={"required_keys": "name"})
    assert resolve("json", options={"required_keys": ["a"]}).score('{"a": 1}', {}).reward == 1.0
