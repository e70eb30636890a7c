"""Tasks: seeded generators, verifiers against independent solutions, the registry."""

import itertools
import random

import pytest

from mcore_rl.errors import TaskError, TokenizerError
from mcore_rl.tasks import (
    ArithmeticTask,
    CountdownTask,
    Problem,
    ReverseTask,
    SortTask,
    available_tasks,
    get_task,
    register_task,
    sample_problems,
)
from mcore_rl.tokenizer import CharTokenizer


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "sort", "reverse"])
def test_generators_are_seeded_and_targets_score_one(name):
    task = get_task(name)
    first = sample_problems(task, 50, seed=3)
    assert first == sample_problems(task, 50, seed=3)
    assert first != sample_problems(task, 50, seed=4)
    tokenizer = CharTokenizer()
    for problem in first:
        tokenizer.encode(problem.prompt + problem.target)  # every char in the alphabet
        assert task.reward(problem, problem.target) == 1.0
        assert task.reward(problem, "") == 0.0


def test_arithmetic_rewards_exact_close_and_garbage():
    task = ArithmeticTask(max_operand=9, ops="+-*", partial_credit=0.3)
    problem = Problem(prompt="7*8=", target="56", data=(7, "*", 8, 56))
    assert task.reward(problem, "56") == 1.0
    close, far = task.reward(problem, "55"), task.reward(problem, "1")
    assert 0.0 < far < close <= 0.3
    assert task.reward(problem, "5+6") == 0.0
    for problem in sample_problems(task, 100, seed=0):
        a, op, b, result = problem.data
        assert result == {"+": a + b, "-": a - b, "*": a * b}[op]


def _countdown_solvable(numbers, target):
    # Independent brute force: every subset order and operator sequence, left to right.
    for k in range(2, len(numbers) + 1):
        for chosen in itertools.permutations(numbers, k):
            for ops in itertools.product("+-*", repeat=k - 1):
                expression = str(chosen[0]) + "".join(f"{o}{n}" for o, n in zip(ops, chosen[1:]))
                if eval(expression) == target:  # test-only reference on trusted text
                    return True
    return False


def test_countdown_targets_are_reachable_and_verified():
    task = CountdownTask(num_numbers=3, max_number=9)
    for problem in sample_problems(task, 40, seed=1):
        numbers, target = problem.data
        assert _countdown_solvable(numbers, target)
    problem = Problem(prompt="C:2,3,4>14=", target="2+3*4", data=((2, 3, 4), 14))
    assert task.reward(problem, "3*4+2") == 1.0
    assert task.reward(problem, "4*4-2") == 0.0  # 4 used twice
    assert task.reward(problem, "2+3") == pytest.approx(0.1)  # valid, wrong value
    assert task.reward(problem, "__import__('os')") == 0.0


def test_sort_and_reverse_match_python():
    rng = random.Random(0)
    for task, fn in [(SortTask(), sorted), (ReverseTask(), lambda v: v[::-1])]:
        for problem in [task.generate(rng) for _ in range(30)]:
            values = [int(v) for v in problem.prompt[2:-1].split(",")]
            assert problem.target == ",".join(map(str, fn(values)))
    problem = Problem(prompt="S:3,1,2=", target="1,2,3", data=((1, 2, 3),))
    assert SortTask().reward(problem, "1,3,3") == pytest.approx(0.5 * 2 / 3)
    assert SortTask().reward(problem, "1,2") == 0.0


def test_register_callable_task_and_reward_range_checked():
    def generate(rng):
        n = rng.randint(0, 9)
        return Problem(prompt=f"{n}=", target=str(n))

    register_task("echo-test", generate, lambda p, c: 2.0 if c == p.target else 0.0)
    assert "echo-test" in available_tasks()
    task = get_task("echo-test")
    problem = task.generate(random.Random(0))
    assert task.reward(problem, "x") == 0.0
    with pytest.raises(TaskError, match=r"reward=2\.0"):
        task.reward(problem, problem.target)
    with pytest.raises(TaskError, match="already registered"):
        register_task("echo-test", generate, lambda p, c: 0.0)
    with pytest.raises(TaskError, match="not registered"):
        get_task("no-such-task")


def test_task_options_are_validated():
    with pytest.raises(TaskError, match="ops="):
        ArithmeticTask(ops="/")
    with pytest.raises(TaskError, match="num_numbers=1"):
        CountdownTask(num_numbers=1)


def test_tokenizer_round_trip_and_errors():
    tokenizer = CharTokenizer()
    ids = tokenizer.encode("12+3=")
    assert ids[0] == tokenizer.bos_id
    assert tokenizer.decode([*ids, tokenizer.eos_id, 5]) == "12+3="
    with pytest.raises(TokenizerError, match="'x'"):
        tokenizer.encode("x")
    with pytest.raises(TokenizerError, match="id=999"):
        tokenizer.decode([999])


def test_registered_callable_task_brings_its_alphabet_to_the_tokenizer():
    def generate(rng):
        word = "".join(rng.choice("abc") for _ in range(3))
        return Problem(prompt=f"{word}?", target=word[::-1])

    register_task(
        "reverse-letters-test",
        generate,
        lambda p, c: float(c == p.target),
        alphabet="abc?",
        overwrite=True,
    )
    task = get_task("reverse-letters-test")
    assert task.alphabet == "abc?"
    problem = task.generate(random.Random(1))
    tokenizer = CharTokenizer(task.alphabet)
    ids = tokenizer.encode(problem.prompt + problem.target)
    assert tokenizer.decode(ids) == problem.prompt + problem.target
    with pytest.raises(TokenizerError):  # the default alphabet has no letters a, b
        CharTokenizer().encode("ab")


def test_register_task_rejects_a_bad_alphabet_and_registers_nothing():
    with pytest.raises(TaskError, match="alphabet='aa'"):
        register_task(
            "bad-alphabet-test", lambda rng: Problem("a", "a"), lambda p, c: 0.0, alphabet="aa"
        )
    assert "bad-alphabet-test" not in available_tasks()
