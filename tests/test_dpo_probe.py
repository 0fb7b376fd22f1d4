"""The DPO isolation probe runs through the padding-free forward training calls; seq_idx reaches hybrids."""

import pytest
from _hf_models import tiny_llama, torch

trl_utils = pytest.importorskip("trl.trainer.utils")

from packtools.compat import undo  # noqa: E402
from packtools.errors import PackingError  # noqa: E402
from packtools.integrations.preference import dpo as pt_trl  # noqa: E402
from packtools.integrations.preference.probe import check_padding_free_forward  # noqa: E402


def fused(model):
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    return model


def test_probe_passes_on_the_real_forward_and_catches_a_broken_one(monkeypatch):
    model = fused(tiny_llama("sdpa"))
    pt_trl.install_padding_free_forward(model)
    assert check_padding_free_forward(model) < 1e-5
    # Negative control: transformers no longer finding the packed sequences in position_ids (its sdpa mask
    # then spans the whole row) must be caught.
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda *a, **k: None)
    with pytest.raises(PackingError, match="see each other"):
        check_padding_free_forward(model)
    monkeypatch.undo()
    undo(model)  # the change install_padding_free_forward recorded on the model
    assert "_packtools_padding_free" not in vars(model)


def test_seq_idx_reaches_a_model_that_names_it():
    model = fused(tiny_llama("sdpa"))
    seen = {}
    inner = model.forward

    def forward(*args, seq_idx=None, **kwargs):  # a hybrid-style forward that reads seq_idx
        seen["seq_idx"] = seq_idx
        return inner(*args, **kwargs)

    model.forward = forward
    pt_trl.install_padding_free_forward(model)
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = (ids != 0).long()
    model(input_ids=ids, attention_mask=mask, labels=ids, fused_lm_head=True)
    assert seen["seq_idx"].tolist() == [[0, 0, 0, 1, 1]]


@pytest.mark.parametrize("scaled", [False, True])
def test_dpo_step_scaling_follows_the_trainer_predicate(tmp_path, scaled):
    """Flip the predicate Trainer reads (loss_is_scaled_for_ga): Trainer then divides by the accumulation steps
    or not, and the step must stay the mean over all its pairs either way (the old code assumed a division
    and would be 3x off with True)."""
    import test_dpo

    prepared, _ = test_dpo.packed_trainer(
        tmp_path,
        max_length=64,
        gradient_accumulation_steps=3,
        per_device_train_batch_size=1,
        max_steps=1,
        remove_unused_columns=False,
    )
    prepared.loss_is_scaled_for_ga = scaled
    step, seen = test_dpo.step_gradients(prepared)
    micro = [p for batch in seen[:3] for row in batch for p in row]
    reference = test_dpo.build(tmp_path, n=16)
    whole = test_dpo.loss_metrics_grads(reference, test_dpo.trl_batch(reference, micro))[2]
    assert max(float((step[k] - whole[k]).abs().max()) for k in whole) < test_dpo.TOL
