"""Resuming training: the batches, losses and weights of a resumed run are those of the uninterrupted run.

The oracle: a run straight through, saving a checkpoint at step ``k``, against a new process (new model, new
trainer) resumed from that checkpoint: every later optimizer step trains on the same documents in the same
micro-batches (read from what the model's forward received), logs the same loss and ``num_input_tokens_seen``,
and the final weights agree to 1e-6 (``tests/_resume_worker.py``).  In an accelerate loop of one's own, a
packtools batch sampler's epoch reaches it through ``skip_first_batches``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import _launch
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from packtools.batches import TokenBudgetBatchSampler  # noqa: E402
from packtools.batches.row_sampler import RowBatchSampler  # noqa: E402

HERE = Path(__file__).parent
LENGTHS = [5, 9, 3, 12, 7, 7, 2, 11, 6, 8, 4, 10, 9, 3, 5, 12, 1, 6]


def sampler(kind: str):
    if kind == "budget":
        return TokenBudgetBatchSampler(LENGTHS, 16, seed=3)
    return RowBatchSampler(len(LENGTHS), 2, seed=3)


def prepared_loader(kind: str):
    acc = accelerate.Accelerator(cpu=True)
    loader = torch.utils.data.DataLoader(range(len(LENGTHS)), batch_sampler=sampler(kind))
    return acc, acc.prepare(loader)


@pytest.mark.parametrize("kind", ["budget", "rows"])
def test_skip_first_batches_then_set_epoch_resumes_that_epochs_shuffle(kind):
    """accelerate's resume: ``skip_first_batches(loader, n)`` in a new process, then ``set_epoch(epoch)`` on the
    loader it returns.  That reached a packtools batch sampler only through ``.sampler`` (under accelerate's
    ``SkipBatchSampler``), so the resumed epoch silently kept epoch 0's shuffle: rows trained twice and others
    never (accelerate's own seedable sampler gets its epoch there)."""
    _, straight = prepared_loader(kind)
    epochs = []
    for epoch in range(3):
        straight.set_epoch(epoch)
        epochs.append([[int(i) for i in b] for b in straight])
    assert epochs[1] != epochs[0]  # the epochs are different shuffles: the check below can fail
    acc, fresh = prepared_loader(kind)  # the resumed process: 2 batches into epoch 1
    skipped = acc.skip_first_batches(fresh, 2)
    skipped.set_epoch(1)
    assert [[int(i) for i in b] for b in skipped] == epochs[1][2:]
    fresh.set_epoch(2)
    assert [[int(i) for i in b] for b in fresh] == epochs[2]


# -- Trainer: a run resumed from its checkpoint against the run straight through ------------------------------
def launch(out: Path, case: dict, phase: str, nproc: int = 1, fails: bool = False) -> list | str:
    args = (str(out), json.dumps(case), phase)
    if nproc > 1:
        cmd = _launch.torchrun_command(nproc, HERE / "_resume_worker.py", *args)
    else:
        cmd = [sys.executable, str(HERE / "_resume_worker.py"), *args]
    log = out.parent / f"{out.name}-{phase}.log"
    code, stdout, stderr = _launch.run(cmd, log, timeout=600, check=not fails, lock=nproc > 1)
    if fails:  # the run must stop with an error: its output, to read the message from
        assert code != 0, "the run did not fail"
        return stdout + stderr
    return torch.load(out / f"{phase}.pt", weights_only=False)


def assert_resumed_like_straight(full: list, resumed: list, k: int) -> None:
    for f, r in zip(full, resumed, strict=True):
        later = [s for s in f["steps"] if s[0] > k]
        assert later and r["steps"] == later  # the same documents in the same micro-batches, step by step
        assert all(
            d >= 0 for _, step in f["steps"] for batch in step for d in batch
        )  # every piece a document
        for key in ("loss", "seen"):
            want = {s: v for s, v in f[key].items() if s > k}
            got = {s: v for s, v in r[key].items() if s > k}
            assert got.keys() == want.keys()
            if key == "loss":
                assert all(abs(got[s] - want[s]) <= 1e-6 for s in want), (got, want)
            else:  # num_input_tokens_seen; TRL's own num_tokens restarts at 0 on resume, packed or not
                assert {s: v[0] for s, v in got.items()} == {s: v[0] for s, v in want.items()}
        diff = max(float((f["params"][n] - r["params"][n]).abs().max()) for n in f["params"])
        assert diff <= 1e-6
        assert r["global_step"] == f["global_step"]


CASES = {
    # token budget, accumulation 2, resumed one optimizer step into epoch 1 (steps 1-5 are epoch 0); attention
    # dropout, so the RNG state the checkpoint restores counts too
    "budget_mid_epoch1": ({"data": "rows", "prepare": {"max_tokens": 64}, "k": 6, "dropout": 0.2}, 1),
    # SFTTrainer with packed_sft_config and prepare_trainer, resumed at the end of epoch 0
    "sft_epoch_boundary": ({"trainer": "sft", "data": "rows", "prepare": {}, "k": 5}, 1),
    # two processes, token budget, one step into epoch 1
    "budget_two_processes": ({"data": "rows", "prepare": {"max_tokens": 64}, "k": 4, "n": 64}, 2),
    # rows of a packed_view (gathered by ArrowCollator), token budget, mid-epoch 0
    "packed_view": ({"data": "view", "prepare": {"max_tokens": 64}, "k": 6}, 1),
    # TRL's DPOTrainer with prepare_dpo_trainer, unpacked pairs by token budget, two processes, mid-epoch 0
    "dpo_two_processes": (
        {
            "trainer": "dpo",
            "data": "plain",
            "prepare": {"max_tokens": 128},
            "k": 3,
            "n": 32,
            "pieces": True,
            "ga": 1,
        },
        2,
    ),
    # TRL's KTOTrainer with prepare_kto_trainer (TRL's own loader, which KTO's loss wants sequential), two processes
    "kto_two_processes": (
        {
            "trainer": "kto",
            "data": "plain",
            "prepare": {},
            "k": 2,
            "n": 24,
            "pieces": True,
            "sampling": "sequential",
        },
        2,
    ),
    # context parallelism: 2 processes, each row split over both (its pieces recorded), accumulation 2
    "context_parallel": (
        {"data": "rows", "prepare": {"context_parallel": 2}, "k": 3, "pieces": True, "tokens_seen": "no"},
        2,
    ),
    # TRL's RewardTrainer with prepare_reward_trainer, packed pairs by token budget, two processes
    "reward_two_processes": (
        {
            **{"trainer": "reward", "data": "plain", "packed_pairs": True},
            **{"prepare": {"max_tokens": 160}, "k": 3, "n": 32, "pieces": True, "ga": 1},
        },
        2,
    ),
}


TWO_PROCESSES = [name for name, (_, nproc) in CASES.items() if nproc == 2]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """The two-process cases' straight runs in one torchrun launch, then their resumed runs in another (each case
    a new model and trainer in a folder of its own; the resumed runs in processes that never ran the straight
    ones, as with one launch per case), so the launches' start and imports are paid twice, not ten times."""
    out = tmp_path_factory.mktemp("resume-two-processes")
    cases = json.dumps([[name, CASES[name][0]] for name in TWO_PROCESSES])
    for phase in ("full", "resume"):
        cmd = _launch.torchrun_command(2, HERE / "_resume_worker.py", str(out), cases, phase)
        _launch.run(cmd, out / f"{phase}.log", timeout=1200)
    load = lambda name, phase: torch.load(out / name / f"{phase}.pt", weights_only=False)  # noqa: E731
    return {name: (load(name, "full"), load(name, "resume")) for name in TWO_PROCESSES}


def resumed_like_straight_and_the_control_fails(full: list, resumed: list, k: int) -> None:
    assert_resumed_like_straight(full, resumed, k)
    resumed = [dict(resumed[0]), *resumed[1:]]  # a copy: the module's runs stay as they came
    steps = resumed[0]["steps"]  # the comparison sees a resumed run that trains its steps in another order
    resumed[0]["steps"] = [(steps[0][0], steps[1][1]), (steps[1][0], steps[0][1]), *steps[2:]]
    with pytest.raises(AssertionError):
        assert_resumed_like_straight(full, resumed, k)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in CASES if name not in TWO_PROCESSES])
def test_resumed_trainer_trains_what_the_straight_run_trains(tmp_path, name):
    case, nproc = CASES[name]
    full = launch(tmp_path, case, "full", nproc)
    resumed = launch(tmp_path, case, "resume", nproc)
    resumed_like_straight_and_the_control_fails(full, resumed, case["k"])


@pytest.mark.slow
@pytest.mark.xdist_group("resume_two_processes")
@pytest.mark.parametrize("name", TWO_PROCESSES)
def test_resumed_trainer_under_two_processes_trains_what_the_straight_run_trains(two_process_runs, name):
    full, resumed = two_process_runs[name]
    resumed_like_straight_and_the_control_fails(full, resumed, CASES[name][0]["k"])


# The refusal tests' run: token budget, 64 documents, a checkpoint at step 2 of 3.  Each process count's run is
# launched once for the module (saved_run); each test resumes a copy of it, so a refused resume's leftovers never
# reach another test.  One xdist group keeps the tests sharing the one-process run in one process.
REFUSAL_CASE = {"data": "rows", "prepare": {"max_tokens": 64}, "k": 2, "n": 64, "max_steps": 3}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    runs = {}

    def saved(nproc: int, into: Path) -> Path:
        if nproc not in runs:
            runs[nproc] = tmp_path_factory.mktemp(f"refusal-saved-{nproc}")
            launch(runs[nproc], REFUSAL_CASE, "full", nproc)
        shutil.copytree(runs[nproc], into, dirs_exist_ok=True)
        return into

    return saved


@pytest.mark.slow
@pytest.mark.xdist_group("resume_refusals")
@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (1, 2)])
def test_resuming_under_another_process_count_is_refused_by_name(tmp_path, saved_run, saved, resumed):
    """Trainer resumes by the step count alone, skipping that many batches of the epoch laid out for the new
    process count; packtools' batches depend on it, so under another count (token budget, 64 documents, saved
    4 steps in) rows of the interrupted epoch were silently trained twice (2 -> 1: 32 of 64 documents trained
    3 or 4 times in 2 epochs) or never (1 -> 2: 26 documents trained once).  Refused, naming both counts."""
    saved_run(saved, tmp_path)
    out = launch(tmp_path, REFUSAL_CASE, "resume", resumed, fails=True)
    assert f"saved under {saved} process(es) ({saved} data-parallel)" in out, out[-3000:]
    assert f"resumed under {resumed} process(es)" in out and "--nproc_per_node" in out


@pytest.mark.slow
def test_context_parallel_checkpoint_resumed_on_one_process_trains_the_straight_runs_batches(tmp_path):
    """Saved under context_parallel=2 on 2 processes (one data-parallel process, token budget), resumed on one
    process without CP: every later step trains the documents of a one-process run straight through, in the same
    micro-batches (it was refused as another process count).  Losses and weights agree to float tolerance (the
    first steps ran on CP shards)."""
    case = {"data": "rows", "pack_context_parallel": 2, "k": 3, "pieces": True, "tokens_seen": "no"}
    saved, straight = tmp_path / "cp", tmp_path / "one"
    launch(saved, {**case, "prepare": {"context_parallel": 2, "max_tokens": 64}}, "full", 2)
    resumed = launch(saved, {**case, "prepare": {"max_tokens": 64}}, "resume")
    full = launch(straight, {**case, "prepare": {"max_tokens": 64}}, "full")
    later = [s for s in full[0]["steps"] if s[0] > case["k"]]
    assert later and resumed[0]["steps"] == later and resumed[0]["global_step"] == full[0]["global_step"]
    want = {s: v for s, v in full[0]["loss"].items() if s > case["k"]}
    got = {s: v for s, v in resumed[0]["loss"].items() if s > case["k"]}
    assert got.keys() == want.keys() and all(abs(got[s] - want[s]) <= 1e-4 for s in want), (got, want)
    params = full[0]["params"]
    assert max(float((params[n] - resumed[0]["params"][n]).abs().max()) for n in params) <= 1e-4


@pytest.mark.slow
@pytest.mark.xdist_group("resume_refusals")
def test_resuming_with_another_shuffle_seed_is_refused_by_name(tmp_path, saved_run):
    """packtools' epoch shuffle is a function of (data_seed or seed, epoch): resumed with another seed, Trainer
    skipped the saved step count of another shuffle, so rows of the interrupted epoch were trained twice or
    never, with no error (the record held no seed).  Refused, naming the saved and the new seed."""
    saved_run(1, tmp_path)
    out = launch(tmp_path, {**REFUSAL_CASE, "seed": 4}, "resume", fails=True)
    assert "saved with data_seed (or seed)=3 (now 4)" in out, out[-3000:]


def test_the_shuffle_seed_is_recorded_where_packtools_shuffles(tmp_path):
    """The seed of the epoch shuffle (data_seed, else seed) is recorded and compared, where packtools' sampler
    lays out the epoch (max_tokens, or several processes) and where Trainer's own sampler is kept (one process,
    rows); a record written without it, or with None for Trainer's sampler (5545339), is not compared on it."""
    from types import SimpleNamespace as N

    from packtools.errors import PackingError
    from packtools.integrations.trainers.resume import check_resume, run_layout, save_layout

    def layout(max_tokens=64, world=1, **seeds):
        args = N(world_size=world, per_device_train_batch_size=2, gradient_accumulation_steps=1, **seeds)
        return run_layout(N(args=args), N(dp_size=world), max_tokens)

    save_layout(str(tmp_path), layout(seed=3))
    check_resume(str(tmp_path), layout(seed=3, data_seed=None))
    with pytest.raises(PackingError, match=r"data_seed \(or seed\)=3 \(now 5\)"):
        check_resume(str(tmp_path), layout(seed=3, data_seed=5))
    assert layout(None, seed=3)["shuffle_seed"] == 3 and layout(None, 2, seed=3)["shuffle_seed"] == 3
    old = layout(seed=3)
    del old["shuffle_seed"]
    save_layout(str(tmp_path), old)
    check_resume(str(tmp_path), layout(seed=9))
    save_layout(str(tmp_path), {**layout(None, seed=3), "shuffle_seed": None})  # Trainer's sampler, before
    check_resume(str(tmp_path), layout(None, seed=9))


@pytest.mark.parametrize(
    "changed, said",
    [
        ({"seed": 2}, r"data_seed \(or seed\)=1 \(now 2\)"),
        ({"data_seed": 7}, r"data_seed \(or seed\)=1 \(now 7\)"),
        (
            {"train_sampling_strategy": "group_by_length"},
            r"train_sampling_strategy=random \(now group_by_length\)",
        ),
        ({"dataloader_drop_last": True}, r"dataloader_drop_last=False \(now True\)"),
        ({"rows": 30}, r"the training dataset's rows=32 \(now 30\)"),
    ],
)
def test_resumed_with_another_order_or_dataset_is_refused(tmp_path, changed, said):
    """One process without max_tokens keeps Trainer's own sampler, which accelerate shuffles each epoch by
    data_seed (else the seed Trainer set): resumed with another seed, Trainer skipped the saved steps of
    another shuffle (steps 3-4 of 8 were other rows than the straight run's) and 5545339 accepted it silently
    (it recorded no seed there); another sampling strategy or drop_last moves the batches the same way.  The
    same settings resume.  So does another training dataset (packed again with another max_length, filtered
    otherwise: 32 rows -> 30), laid out in other batches."""
    from packtools import prepare_trainer
    from packtools.errors import PackingError

    def trainer(max_steps, rows=32, **extra):
        options = {"seed": 1, "auto_find_batch_size": False, "fail": False, **extra}
        made = oom_once_trainer(tmp_path, max_steps, **options)
        made.train_dataset = made.train_dataset.select(range(rows))
        return prepare_trainer(made)

    trainer(2).train()
    checkpoint = str(tmp_path / "checkpoint-2")
    with pytest.raises(PackingError, match=said):
        trainer(3, **changed).train(resume_from_checkpoint=checkpoint)
    trainer(3).train(resume_from_checkpoint=checkpoint)


@pytest.mark.slow
@pytest.mark.xdist_group("resume_refusals")
def test_resuming_with_another_token_budget_is_refused_by_name(tmp_path, saved_run):
    """A lower max_tokens after an out-of-memory error: Trainer skips the saved step count of smaller batches,
    so rows of the interrupted epoch were trained again, silently.  Refused, naming the saved and new budget."""
    saved_run(1, tmp_path)
    out = launch(tmp_path, {**REFUSAL_CASE, "resume_prepare": {"max_tokens": 32}}, "resume", fails=True)
    assert "saved with max_tokens=64 (now 32)" in out, out[-3000:]


def test_the_layout_record_of_the_last_checkpoint_is_what_resume_true_checks(tmp_path):
    """``resume_from_checkpoint=True`` resumes from the last ``checkpoint-N`` of ``output_dir``: its record is
    the one compared; the same layout passes, another is refused, a folder with no step count to skip is not checked."""
    from types import SimpleNamespace

    from packtools.errors import PackingError
    from packtools.integrations.trainers.resume import check_resume, checkpoint_folder, save_layout

    layout = {"processes": 2, "data_parallel": 2, "max_tokens": 64, "rows_per_batch": None, "accumulation": 2}
    for step in (5, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
    save_layout(str(tmp_path / "checkpoint-5"), {**layout, "processes": 1, "data_parallel": 1})
    save_layout(str(tmp_path / "checkpoint-10"), layout)
    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path)))
    last = checkpoint_folder(trainer, True)
    assert last == str(tmp_path / "checkpoint-10") and checkpoint_folder(trainer, None) is None
    check_resume(last, layout)
    with pytest.raises(
        PackingError, match=r"saved under 2 process\(es\) \(2 data-parallel\).*under 1 process"
    ):
        check_resume(last, {**layout, "processes": 1, "data_parallel": 1})
    with pytest.raises(PackingError, match=r"gradient_accumulation_steps=2 \(now 4\)"):
        check_resume(last, {**layout, "accumulation": 4})
    check_resume(str(tmp_path), {**layout, "processes": 8})  # no trainer_state.json: nothing


def test_another_process_count_with_the_same_data_parallel_processes_is_resumed(tmp_path):
    """The processes of a context-parallel group read one batch: CP=2 on 2 processes (one data-parallel
    process) resumed on 1 process, or CP=4 resumed as CP=2, trains the batches the saved run laid out (packtools'
    sampler both times); it was refused as another process count.  Refused still where one side keeps
    Trainer's own sampler (one process, no max_tokens) or the data-parallel count changes."""
    from packtools.errors import PackingError
    from packtools.integrations.trainers.resume import check_resume, save_layout

    cp = {"processes": 2, "data_parallel": 1, "max_tokens": 64, "rows_per_batch": None, "accumulation": 2}
    save_layout(str(tmp_path), cp)
    check_resume(str(tmp_path), {**cp, "processes": 1})
    check_resume(str(tmp_path), {**cp, "processes": 4})
    rows = {**cp, "max_tokens": None, "rows_per_batch": 2}
    save_layout(str(tmp_path), rows)
    check_resume(str(tmp_path), {**rows, "processes": 4})  # CP=2 -> CP=4: packtools' sampler, 1 DP process
    with pytest.raises(PackingError, match=r"saved under 2 process\(es\) \(1 data-parallel\).*under 1 proc"):
        check_resume(str(tmp_path), {**rows, "processes": 1})  # Trainer's own sampler: another shuffle
    with pytest.raises(PackingError, match=r"\(1 data-parallel\).*under 2 process\(es\) \(2 data-parallel"):
        check_resume(str(tmp_path), {**rows, "data_parallel": 2})


class OutOfMemoryOnce:
    """A ``Trainer`` subclass mixin whose first ``training_step`` raises CUDA's out-of-memory error."""

    failed = False

    def training_step(self, *args, **kwargs):
        if not self.failed:
            self.failed = True
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().training_step(*args, **kwargs)


def oom_once_trainer(out, max_steps=2, fail=True, **extra):
    import datasets
    import transformers
    from _hf_models import sequences, tiny_llama

    from packtools import PaddingFreeCollator

    args = transformers.TrainingArguments(
        str(out), max_steps=max_steps, save_steps=2, report_to=[], use_cpu=True, remove_unused_columns=False,
        disable_tqdm=True, **{"per_device_train_batch_size": 4, "auto_find_batch_size": True, **extra},
    )  # fmt: skip
    kind = type("OOMOnce", (OutOfMemoryOnce, transformers.Trainer), {"failed": not fail})
    collator = PaddingFreeCollator(pad_token_id=0, unpacked=True)
    return kind(
        model=tiny_llama(),
        args=args,
        train_dataset=datasets.Dataset.from_list(sequences(32)),
        data_collator=collator,
    )


def test_a_batch_size_lowered_by_auto_find_batch_size_is_refused_where_packtools_batches(tmp_path):
    """``auto_find_batch_size`` retries an out-of-memory step with a lower batch size (4 -> 3 here): with
    ``max_tokens`` packtools' token budget does not follow it, so the retry is refused, naming the fix."""
    from packtools import prepare_trainer
    from packtools.errors import PackingError

    trainer = prepare_trainer(oom_once_trainer(tmp_path), max_tokens=64)
    with pytest.raises(PackingError, match=r"per_device_train_batch_size=4 to 3 .*lower max_tokens=64"):
        trainer.train()
    assert trainer.failed and not (tmp_path / "checkpoint-2").exists()


def test_auto_find_batch_size_with_trainers_own_loader_is_trained_recorded_and_resumed(tmp_path):
    """One process without ``max_tokens`` keeps ``Trainer``'s own loader, which follows the size
    ``auto_find_batch_size`` finds: the retry is exact, but it was refused like a packtools batch.  It trains,
    the record names the size trained (3, not the 4 asked), a resume with ``auto_find_batch_size`` (Trainer
    restores 3) passes, and one with ``per_device_train_batch_size=4`` and no search (batches of 4: the saved
    step count of another layout) is refused."""
    from packtools import prepare_trainer
    from packtools.errors import PackingError

    trainer = prepare_trainer(oom_once_trainer(tmp_path))
    trainer.train()
    assert trainer.failed and trainer.state.train_batch_size == 3
    from packtools.integrations.trainers.resume import saved_layout

    assert saved_layout(str(tmp_path / "checkpoint-2"))["rows_per_batch"] == 3
    checkpoint = str(tmp_path / "checkpoint-2")
    prepare_trainer(oom_once_trainer(tmp_path, 3, fail=False)).train(resume_from_checkpoint=checkpoint)
    fixed = prepare_trainer(oom_once_trainer(tmp_path, 3, fail=False, auto_find_batch_size=False))
    with pytest.raises(PackingError, match=r"per_device_train_batch_size=3 \(now 4\)"):
        fixed.train(resume_from_checkpoint=checkpoint)


def test_a_checkpoint_killed_before_packtools_saw_it_is_still_checked(tmp_path):
    """A process killed (SIGKILL) right after ``Trainer`` saved a checkpoint, before packtools' ``on_save``
    wrote ``packtools_layout.json`` into it: ``resume_from_checkpoint`` (``True`` picks it too) resumed it
    unchecked, here under another ``max_tokens``, training rows twice with no error.  The record now rides in
    the checkpoint's own ``trainer_state.json``, written by ``Trainer`` before any ``on_save``: refused."""
    case = {"data": "rows", "prepare": {"max_tokens": 64}, "k": 2, "max_steps": 3, "kill_at_save": True}
    out = launch(tmp_path, case, "full", fails=True)
    assert (tmp_path / "checkpoint-2" / "trainer_state.json").is_file(), out[-3000:]
    out = launch(tmp_path, {**case, "resume_prepare": {"max_tokens": 32}}, "resume", fails=True)
    assert "saved with max_tokens=64 (now 32)" in out, out[-3000:]


def test_a_checkpoint_with_no_record_anywhere_is_refused_with_the_record_to_write(tmp_path):
    """A checkpoint with ``Trainer``'s state (a step count to skip) and no layout record (saved without
    ``prepare_*``, or by a packtools before the record) was resumed unchecked.  Refused, the message giving the
    record to write; once written (the user's word that the layout is the saved one) it is checked as a record.
    A folder without ``trainer_state.json`` is resumed from step 0 by ``Trainer`` (nothing skipped): passes."""
    from packtools.errors import PackingError
    from packtools.integrations.trainers.resume import LAYOUT_FILE, check_resume

    layout = {"processes": 1, "data_parallel": 1, "max_tokens": 64, "rows_per_batch": None, "accumulation": 1}
    check_resume(str(tmp_path), layout)
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 4, "stateful_callbacks": {}}))
    with pytest.raises(PackingError, match="records no data layout") as caught:
        check_resume(str(tmp_path), layout)
    assert json.dumps(layout) in str(caught.value) and caught.value.param == "resume_from_checkpoint"
    (tmp_path / LAYOUT_FILE).write_text(json.dumps(layout))
    check_resume(str(tmp_path), layout)
    with pytest.raises(PackingError, match=r"max_tokens=64 \(now 32\)"):
        check_resume(str(tmp_path), {**layout, "max_tokens": 32})
    (tmp_path / "trainer_state.json").write_text('{"global_step": 4, "stateful_cal')  # a write cut short
    with pytest.raises(PackingError, match=r"trainer_state.json cannot be read .*resumes from step 0"):
        check_resume(str(tmp_path), layout)


def test_a_hyperparameter_trials_checkpoints_hold_the_trials_layout(tmp_path, monkeypatch):
    """A hyperparameter search saves ``output_dir/run-N/checkpoint-K``, but packtools wrote its record into
    ``output_dir/checkpoint-K`` (absent: no record at all), and recorded the arguments before the trial set
    them.  The trial's checkpoint records the trial's layout (its ``gradient_accumulation_steps`` here), and a
    resume from it under another is refused."""
    from types import SimpleNamespace

    import datasets
    import transformers
    from _hf_models import sequences, tiny_llama
    from transformers.trainer_utils import HPSearchBackend

    from packtools import PaddingFreeCollator, prepare_trainer
    from packtools.errors import PackingError

    def trainer():
        args = transformers.TrainingArguments(
            str(tmp_path), per_device_train_batch_size=2, max_steps=2, save_steps=2, report_to=[],
            use_cpu=True, remove_unused_columns=False, disable_tqdm=True,
        )  # fmt: skip
        collator = PaddingFreeCollator(pad_token_id=0, unpacked=True)
        rows = datasets.Dataset.from_list(sequences(16))
        built = prepare_trainer(
            transformers.Trainer(tiny_llama(), args, train_dataset=rows, data_collator=collator)
        )
        # what Trainer.hyperparameter_search sets before each trial's train(trial=...) (optuna's trial.number)
        built.hp_search_backend, built.hp_space = HPSearchBackend.OPTUNA, lambda t: t.params
        return built

    # optuna is not installed here: its trial is a stand-in, whose parameters Trainer logs through hp_params
    monkeypatch.setattr(transformers.integrations, "hp_params", lambda t: t.params)
    trial = SimpleNamespace(number=0, params={"gradient_accumulation_steps": 2})
    trainer().train(trial=trial)
    other = SimpleNamespace(number=0, params={"gradient_accumulation_steps": 1})
    with pytest.raises(PackingError, match=r"gradient_accumulation_steps=2 \(now 1\)"):
        trainer().train(resume_from_checkpoint=str(tmp_path / "run-0" / "checkpoint-2"), trial=other)
    from packtools.integrations.trainers.resume import saved_layout

    assert saved_layout(str(tmp_path / "run-0" / "checkpoint-2"))["accumulation"] == 2


@pytest.mark.parametrize("text", ["", '{"processes": 2, "data_par', "[1, 2]"])
def test_an_unreadable_layout_record_is_refused_by_name(tmp_path, text):
    """A record that is empty, cut short or not a mapping (a copy interrupted, a file edited by hand) raised
    json's JSONDecodeError (or AttributeError) from train(); refused by name, saying what to do."""
    from packtools.errors import PackingError
    from packtools.integrations.trainers.resume import LAYOUT_FILE, check_resume

    (tmp_path / LAYOUT_FILE).write_text(text)
    layout = {"processes": 1, "data_parallel": 1, "max_tokens": 64, "rows_per_batch": None, "accumulation": 1}
    with pytest.raises(
        PackingError, match=r"packtools_layout.json cannot be read .*delete the file"
    ) as caught:
        check_resume(str(tmp_path), layout)
    assert caught.value.param == "resume_from_checkpoint"


def test_the_layout_record_is_written_whole_under_a_name_of_its_own(tmp_path, monkeypatch):
    """Two processes saving into one checkpoint folder (``save_on_each_node`` on shared storage) shared one
    temporary name: the second ``os.replace`` found it gone (FileNotFoundError in the middle of training).  Each
    process now writes its own temporary file and renames it over the record."""
    from packtools.integrations.trainers import resume

    layout = {"processes": 2, "data_parallel": 2, "max_tokens": None, "rows_per_batch": 2, "accumulation": 1}
    renamed = []
    replace = os.replace

    def other_node_first(src, dst):  # another node renames its temporary file between our write and rename
        if not renamed:
            renamed.append(src)
            resume.save_layout(str(tmp_path), {**layout, "processes": 2})
        replace(src, dst)

    monkeypatch.setattr(resume.os, "replace", other_node_first)
    monkeypatch.setattr(resume.os, "getpid", iter([101, 202]).__next__)
    resume.save_layout(str(tmp_path), layout)
    assert json.loads((tmp_path / resume.LAYOUT_FILE).read_text()) == layout
    assert sorted(os.listdir(tmp_path)) == [resume.LAYOUT_FILE]


def test_a_numpy_token_budget_is_recorded_and_resumed(tmp_path):
    """``prepare_trainer(max_tokens=np.int64(64))`` is accepted (a length read from an array), but the layout
    record kept it as given: json.dump raised TypeError at the first checkpoint, stopping training.  Recorded as
    an int, and a resume with ``max_tokens=64`` passes."""
    import datasets
    import numpy as np
    import transformers
    from _hf_models import sequences, tiny_llama

    from packtools import PaddingFreeCollator, prepare_trainer
    from packtools.integrations.trainers.resume import saved_layout

    def trainer(max_tokens):
        args = transformers.TrainingArguments(
            str(tmp_path), per_device_train_batch_size=2, max_steps=2, save_steps=1, report_to=[],
            use_cpu=True, remove_unused_columns=False, disable_tqdm=True,
        )  # fmt: skip
        collator = PaddingFreeCollator(pad_token_id=0, unpacked=True)
        rows = datasets.Dataset.from_list(sequences(16))
        built = transformers.Trainer(tiny_llama(), args, train_dataset=rows, data_collator=collator)
        prepare_trainer(built, max_tokens=max_tokens)
        return built

    trainer(np.int64(64)).train()
    assert saved_layout(str(tmp_path / "checkpoint-1"))["max_tokens"] == 64
    trainer(64).train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))


def test_the_trainers_that_keep_trls_loader_change_no_loader_method():
    """``prepare_kto_trainer``, ``prepare_distillation_trainer`` and ``prepare_grpo_trainer`` record no layout
    (docs/training.md): a resume there is TRL's own because packtools leaves their loader and ``train`` alone
    (GRPO's ``_get_train_sampler`` only permutes whole groups inside each generation batch,
    ``tests/test_grpo.py``).  A loader override added to one of them must come with the layout record."""
    from packtools.integrations.preference import kto
    from packtools.integrations.rl.distillation import PackedDistillationStep
    from packtools.integrations.rl.grpo import PackedRLStep

    loader = {"get_train_dataloader", "_get_train_sampler", "train", "_get_dataloader", "get_batch_samples"}
    assert not loader & set(vars(PackedDistillationStep))
    assert loader & set(vars(PackedRLStep)) == {"_get_train_sampler"}
    assert "install_step" not in vars(kto)  # no class swap: the trainer's own methods run


def test_a_checkpoint_saved_by_a_plain_run_resumed_from_a_prepared_ones_is_refused(tmp_path):
    """The record rides in trainer_state.json, which Trainer loads on resume and writes again into every later
    checkpoint: a run without packtools (unprepared) resumed from a prepared run's checkpoint carried that run's
    record into its own checkpoints, so a prepared resume from them was checked against a layout that did not
    lay out their steps (here Trainer's loader of 4 rows, not the recorded max_tokens=64) and accepted, silently.
    The record names the step it was written at; a checkpoint of another step is refused as one with none."""
    from packtools import prepare_trainer
    from packtools.errors import PackingError
    from packtools.integrations import unprepare

    def trainer(max_steps, **prepare):
        made = oom_once_trainer(tmp_path, max_steps, seed=1, auto_find_batch_size=False, fail=False)
        return prepare_trainer(made, **prepare)

    trainer(2, max_tokens=64).train()
    plain = unprepare(trainer(4, max_tokens=64))
    plain.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    with pytest.raises(PackingError, match="records no data layout"):
        trainer(6, max_tokens=64).train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    trainer(4, max_tokens=64).train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))  # its own: resumed


def test_a_checkpoint_at_step_zero_is_resumed_without_a_record(tmp_path):
    """trainer_state.json at global_step 0 (saved before the first step) skips no batch under any layout: no
    record needed, and a record of another layout is no reason to refuse; at step 3 both are refused."""
    import json
    from types import SimpleNamespace as N

    from packtools.errors import PackingError
    from packtools.integrations.trainers.resume import STATE_FILE, check_resume, run_layout, save_layout

    args = N(world_size=1, per_device_train_batch_size=2, gradient_accumulation_steps=1, seed=3)
    current = run_layout(N(args=args), N(dp_size=1), 64)
    for step in (0, 3):
        (tmp_path / STATE_FILE).write_text(json.dumps({"global_step": step, "stateful_callbacks": {}}))
        if step == 0:
            check_resume(str(tmp_path), current)
            save_layout(str(tmp_path), {**current, "max_tokens": 32})
            check_resume(str(tmp_path), current)
            (tmp_path / "packtools_layout.json").unlink()
        else:
            with pytest.raises(PackingError, match="records no data layout"):
                check_resume(str(tmp_path), current)


@pytest.mark.parametrize("sampling", ["sequential", "random", "group_by_length"])
@pytest.mark.parametrize("rows", [10, None])
def test_a_seed_change_is_refused_only_where_trainers_sampler_shuffles_by_it(tmp_path, sampling, rows):
    """With Trainer's own sampler (one process, no max_tokens), a data_seed/seed change moves the batches only
    where the sampler shuffles by it: train_sampling_strategy='sequential' or a dataset without a length
    (IterableDataset: no sampler) keep the dataset's order, so the change is accepted; 'random' and
    'group_by_length' over a sized dataset shuffle by it and are refused, and so is a subclass's own sampler."""
    from types import SimpleNamespace as N

    import datasets

    from packtools.errors import PackingError
    from packtools.integrations.trainers.resume import check_resume, run_layout, save_layout

    class Rows:
        def __len__(self):
            return rows

    class OwnSampler(transformers.Trainer):
        def _get_train_sampler(self, dataset=None):
            return None

    def layout(seed, cls=transformers.Trainer):
        trainer = cls.__new__(cls)  # run_layout reads its args, its dataset and its class only
        trainer.args = N(
            world_size=1, per_device_train_batch_size=2, gradient_accumulation_steps=1, seed=seed
        )
        trainer.args.train_sampling_strategy = sampling
        trainer.train_dataset = Rows() if rows is not None else datasets.IterableDataset.from_generator(list)
        return run_layout(trainer, N(dp_size=1), None)

    save_layout(str(tmp_path), layout(3))
    check_resume(str(tmp_path), layout(3))
    if sampling == "sequential" or rows is None:
        check_resume(str(tmp_path), layout(4))
        save_layout(str(tmp_path), {**layout(3), "shuffle_seed": 3})  # recorded by a packtools before this
        check_resume(str(tmp_path), layout(4))
    else:
        with pytest.raises(PackingError, match=r"data_seed \(or seed\)=3 \(now 4\)"):
            check_resume(str(tmp_path), layout(4))
    save_layout(str(tmp_path), layout(3, OwnSampler))
    with pytest.raises(PackingError, match=r"data_seed \(or seed\)=3 \(now 4\)"):
        check_resume(str(tmp_path), layout(4, OwnSampler))


def test_a_seed_change_over_a_stream_of_ones_own_is_still_refused(tmp_path):
    """A torch IterableDataset of one's own may shuffle with the process's random state, which Trainer seeds with
    ``seed`` (its __init__) before the resumed epoch's iterator starts: another seed, another order, other rows
    in the skipped batches (shown below).  Only a datasets.IterableDataset (its own generators) is accepted."""
    import random
    from types import SimpleNamespace as N

    from packtools.errors import PackingError
    from packtools.integrations.trainers.resume import check_resume, run_layout, save_layout

    class Shuffled(torch.utils.data.IterableDataset):
        def __iter__(self):
            rows = list(range(16))
            random.shuffle(rows)
            return iter(rows)

    def order(seed):
        transformers.set_seed(seed)  # what Trainer does with args.seed
        return list(Shuffled())

    assert order(3) == order(3) != order(4)

    def layout(seed, dataset):
        trainer = transformers.Trainer.__new__(transformers.Trainer)
        trainer.args = N(
            world_size=1, per_device_train_batch_size=2, gradient_accumulation_steps=1, seed=seed
        )
        trainer.args.train_sampling_strategy = "random"
        trainer.train_dataset = dataset
        return run_layout(trainer, N(dp_size=1), None)

    save_layout(str(tmp_path), layout(3, Shuffled()))
    check_resume(str(tmp_path), layout(3, Shuffled()))
    with pytest.raises(PackingError, match=r"data_seed \(or seed\)=3 \(now 4\)"):
        check_resume(str(tmp_path), layout(4, Shuffled()))


def test_a_checkpoint_whose_token_batches_repeated_rows_is_refused_where_they_now_sit_out(tmp_path):
    """prepare_trainer(max_tokens) under 2 processes, 5 rows of one batch each: packtools before repeat_rows=False
    repeated a row (3 batches a rank per epoch), now the row sits out (2 a rank).  Its checkpoint records the same
    layout, so a resume passed the check and Trainer skipped the saved steps of the new, shorter epoch: rows of
    the interrupted epoch trained twice or never, and the epoch count off.  The record now says how many rows sit
    out; a record without it whose run leaves rows out is refused by name."""
    import types
    import warnings

    datasets = pytest.importorskip("datasets")
    from packtools.errors import PackingError
    from packtools.integrations.trainers.loader import make_sampler
    from packtools.integrations.trainers.resume import check_resume, run_layout, save_layout

    lengths = [32, 32, 31, 28, 24]
    ds = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in lengths]})
    args = types.SimpleNamespace(
        seed=0, data_seed=None, per_device_train_batch_size=1, world_size=2, gradient_accumulation_steps=1
    )
    trainer = types.SimpleNamespace(args=args, train_dataset=ds)
    layout = types.SimpleNamespace(dp_size=2, dp_rank=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_sampler(trainer, ds, 48, layout)  # Trainer builds its loader before the record is taken
    current = run_layout(trainer, layout, 48)
    assert current["rows_left_out"] == 1
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    old = {k: v for k, v in current.items() if k != "rows_left_out"}  # what the earlier packtools recorded
    save_layout(str(tmp_path), old)
    with pytest.raises(
        PackingError, match=r"repeated row\(s\) of each epoch.*now 1 row\(s\) of each epoch sit it out"
    ):
        check_resume(str(tmp_path), current)
    check_resume(str(tmp_path), {**current, "rows_left_out": 0})  # no row repeated then: the same batches
    save_layout(str(tmp_path), current)
    check_resume(str(tmp_path), current)
