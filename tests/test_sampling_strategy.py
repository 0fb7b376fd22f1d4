"""``train_sampling_strategy`` where packtools' loader replaces ``Trainer``'s sampler (``max_tokens``, several
processes): anything but ``"random"`` would be ignored without a word, so it is refused by name; where
``Trainer``'s own sampler is kept (one process, no ``max_tokens``) it is honoured by ``Trainer``."""

import pytest
from _hf_models import PAD, sequences, tiny_llama, transformers
from test_hf import train_args

from packtools import PaddingFreeCollator, pack_dataset, prepare_trainer
from packtools.errors import PackingError
from packtools.integrations import unprepare

datasets = pytest.importorskip("datasets")


def trainer(tmp_path, strategy):
    rows = pack_dataset(datasets.Dataset.from_list(sequences(16, seed=2)), 32)
    args = train_args(tmp_path, train_sampling_strategy=strategy)
    return transformers.Trainer(
        model=tiny_llama(), args=args, train_dataset=rows, data_collator=PaddingFreeCollator(PAD)
    )


@pytest.mark.parametrize("strategy", ["sequential", "group_by_length", "batch_rebalance"])
def test_a_strategy_the_token_budget_loader_would_ignore_is_refused(tmp_path, strategy):
    t = trainer(tmp_path, strategy)
    with pytest.raises(
        PackingError, match=rf"train_sampling_strategy='{strategy}' with max_tokens=64"
    ) as err:
        prepare_trainer(t, max_tokens=64, check_isolation=False)
    assert err.value.param == "train_sampling_strategy"
    assert "'random'" in str(err.value)


def test_random_is_packtools_own_shuffle_and_one_process_keeps_trainers_sampler(tmp_path):
    t = trainer(tmp_path, "random")
    prepare_trainer(t, max_tokens=64, check_isolation=False)  # accepted
    unprepare(t)
    t = trainer(tmp_path, "sequential")  # one process, no max_tokens: Trainer's own sampler, honoured
    prepare_trainer(t, check_isolation=False)
    sampler = t.get_train_dataloader().base_dataloader.sampler
    assert isinstance(sampler, __import__("torch").utils.data.SequentialSampler), type(sampler)


def test_drop_last_the_token_budget_loader_does_not_apply_is_said(tmp_path):
    """dataloader_drop_last=True was ignored silently by packtools' loader (every row trained, no last batch
    dropped): it warns by name; Trainer's own loader (one process, no max_tokens) honours it, no warning."""
    rows = pack_dataset(datasets.Dataset.from_list(sequences(16, seed=2)), 32)

    def built():
        args = train_args(tmp_path, dataloader_drop_last=True)
        return transformers.Trainer(
            model=tiny_llama(), args=args, train_dataset=rows, data_collator=PaddingFreeCollator(PAD)
        )

    with pytest.warns(UserWarning, match=r"dataloader_drop_last=True is not applied"):
        prepare_trainer(built(), max_tokens=64, check_isolation=False)
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*dataloader_drop_last")
        prepare_trainer(built(), check_isolation=False)
