"""Test-only: a byte-level BPE whose pre-tokenizer is a custom Split regex (GPT-2's without ``\\s+(?!\\S)``,
the form engines without look-ahead need), on which fastokens' ``\\s`` (it includes U+180E) differs from
Oniguruma's (issue 29, S4)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import transformers
from _pipeline_data import CORPUS, EOS
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

PAT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+"


def build(path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PAT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, tr)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.save_pretrained(path)
    return path
