"""Prompt datasets: JSONL and Parquet give the same problems, seeded shuffles per epoch, the
held-out split, prompts too long for the context, and clear errors for bad files."""

import json

import pytest

from mcore_rl.config import DataConfig
from mcore_rl.errors import RLDataError
from mcore_rl.prompt_data import load_prompt_dataset, load_records

RECORDS = [{"question": f"q{i}", "answer": f"#### {i}", "extra": i} for i in range(10)]


def _jsonl(path, records=RECORDS):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _config(path, **fields):
    return DataConfig(path=path, prompt_field="question", **fields)


def test_jsonl_and_parquet_load_the_same_records(tmp_path):
    parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    parquet.write_table(pyarrow.Table.from_pylist(RECORDS), tmp_path / "data.parquet")
    from_jsonl = load_records(_jsonl(tmp_path / "data.jsonl"))
    from_parquet = load_records(str(tmp_path / "data.parquet"))
    assert from_jsonl == from_parquet == RECORDS
    a = load_prompt_dataset(_config(str(tmp_path / "data.jsonl")), seed=0)
    b = load_prompt_dataset(_config(str(tmp_path / "data.parquet")), seed=0)
    assert a.train == b.train and [p.target for p in a.train] == [f"#### {i}" for i in range(10)]


def test_steps_walk_seeded_epochs_without_repeats_inside_an_epoch(tmp_path):
    dataset = load_prompt_dataset(_config(_jsonl(tmp_path / "d.jsonl")), seed=3)
    steps = [dataset.problems_for_step(step, 5) for step in range(4)]
    epoch0 = [p.prompt for p in steps[0] + steps[1]]
    epoch1 = [p.prompt for p in steps[2] + steps[3]]
    assert sorted(epoch0) == sorted(epoch1) == sorted(r["question"] for r in RECORDS)
    assert epoch0 != epoch1  # reshuffled every epoch
    # The order depends only on the seed: the same seed gives the same steps, another differs.
    again = load_prompt_dataset(_config(_jsonl(tmp_path / "d.jsonl")), seed=3)
    assert [again.problems_for_step(s, 5) for s in range(4)] == steps
    other = load_prompt_dataset(_config(_jsonl(tmp_path / "d.jsonl")), seed=4)
    assert [other.problems_for_step(s, 5) for s in range(2)] != steps[:2]


def test_epochs_bound_the_steps(tmp_path):
    dataset = load_prompt_dataset(_config(_jsonl(tmp_path / "d.jsonl"), epochs=2), seed=0)
    assert dataset.max_steps(4) == 5
    assert load_prompt_dataset(_config(_jsonl(tmp_path / "d.jsonl")), seed=0).max_steps(4) is None


def test_held_out_split_is_disjoint_and_seeded(tmp_path):
    config = _config(_jsonl(tmp_path / "d.jsonl"), eval_size=3)
    dataset = load_prompt_dataset(config, seed=1)
    assert len(dataset.eval) == 3 and len(dataset.train) == 7
    assert not {p.prompt for p in dataset.eval} & {p.prompt for p in dataset.train}
    assert load_prompt_dataset(config, seed=1).eval == dataset.eval
    separate = _config(_jsonl(tmp_path / "d.jsonl"), eval_path=_jsonl(tmp_path / "e.jsonl"))
    assert len(load_prompt_dataset(separate, seed=1).eval) == 10


def test_prompts_longer_than_the_context_are_skipped_and_counted(tmp_path):
    records = [{"question": "x" * n, "answer": "1"} for n in (1, 5, 2, 9)]
    config = _config(_jsonl(tmp_path / "d.jsonl", records))
    dataset = load_prompt_dataset(config, seed=0, fits=lambda prompt: len(prompt) <= 4)
    assert dataset.skipped == 2
    assert sorted(len(p.prompt) for p in dataset.train) == [1, 2]
    with pytest.raises(RLDataError, match="every one of the 4 training prompts"):
        load_prompt_dataset(config, seed=0, fits=lambda prompt: False)


@pytest.mark.parametrize(
    ("content", "suffix", "fields", "message"),
    [
        (None, ".jsonl", {}, "does not exist"),
        ("", ".jsonl", {}, "holds no records"),
        ('{"question": "q"}\n', ".jsonl", {}, "record 0 .* has no field 'answer'"),
        ('{"q": "a", "answer": 1}\n', ".jsonl", {}, "has no field 'question'"),
        ('{"question": 5, "answer": 1}\n', ".jsonl", {}, "question=5 is not text"),
        ("not json\n", ".jsonl", {}, r"d\.jsonl:1 is not a JSON object"),
        ("[1, 2]\n", ".jsonl", {}, "is list, expected an object"),
        ("a,b\n", ".csv", {}, "suffix '.csv'"),
        ('{"question": "q", "answer": 1}\n', ".jsonl", {"eval_size": 1}, "leaves no training"),
    ],
)
def test_bad_files_raise_clear_errors(tmp_path, content, suffix, fields, message):
    path = tmp_path / f"d{suffix}"
    if content is not None:
        path.write_text(content)
    with pytest.raises(RLDataError, match=message):
        load_prompt_dataset(_config(str(path), **fields), seed=0)


def test_hf_datasets_path_loads_a_local_dataset_or_names_the_missing_package(tmp_path):
    directory = tmp_path / "dataset"
    directory.mkdir()
    _jsonl(directory / "train.jsonl")
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(RLDataError, match="needs the datasets package"):
            load_records(f"hf:{directory}")
    else:
        assert load_records(f"hf:{directory}", split="train") == RECORDS
