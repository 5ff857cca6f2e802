"""Write a tiny random-weight Llama in Hugging Face format, with a tokenizer trained here.

Runs inside the vLLM venv (transformers and tokenizers are vLLM's own dependencies):

    python make_model.py OUT_DIR

No hub is reached: the tokenizer is a byte-level BPE trained on generated text, the weights
are random. Shapes decide the work vLLM does, not the values.
"""
from __future__ import annotations

import json
import os
import random
import sys

# Head size 48 (192 / 4): vLLM's CPU attention takes its vec16 kernels; with a head size
# that is a multiple of 32 and bf16 it takes its AMX kernels, which die of SIGILL on this
# VM (a single short prompt suffices), where the CPU reports AMX but the path fails.
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 4, 192, 4, 2, 512
VOCAB = 1024
WORDS = ("the of and to in is that it for on with as was at by an be this from or have not are "
         "hello world model token layer cache attention vector matrix value query key step batch "
         "request server engine kernel memory thread graph node shape tensor profile time").split()


def corpus(lines: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(lines):
        yield " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) + "."


def main(out: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(4000), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    os.makedirs(out, exist_ok=True)
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=2048,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         torch_dtype="bfloat16", tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    with open(os.path.join(out, "profinfer-model.json"), "w") as f:
        json.dump({"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS}, f)


if __name__ == "__main__":
    main(sys.argv[1])
