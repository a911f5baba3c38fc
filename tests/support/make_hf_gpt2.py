"""Writes tiny random GPT-2 models as Hugging Face's transformers saves them, and their hidden
states, for tests/unit/model/gpt2_test.cpp:

    python make_hf_gpt2.py OUT

OUT/lm      GPT2LMHeadModel.save_pretrained (names with "transformer.", the tied head left out)
OUT/base    GPT2Model.save_pretrained (names without a prefix)
OUT/broken  OUT/lm's tensors with h.1.mlp.c_fc.bias removed and an unexpected "transformer.extra"
OUT/pickle  config.json and a pytorch_model.bin only
OUT/expected.safetensors  input_ids [2, 20] and transformers' last_hidden_state for them; text_ids
                          [3, 12] right-padded with 0 to text_lengths (12, 7, 1), and each text's
                          vector from transformers run on the text alone (no padding): the mean of
                          its hidden states (text_mean) and its last one (text_last)

Exit 77 (the test reports "skipped") when transformers is not installed.
"""
import os
import shutil
import sys

try:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as e:
    print(f"make_hf_gpt2: {e}; scripts/setup.sh installs transformers", file=sys.stderr)
    sys.exit(77)

out = sys.argv[1]
torch.manual_seed(0)
config = GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(config).eval()
with torch.no_grad():  # LayerNorms and biases away from 1 and 0, so a misplaced one shows
    for name, p in model.named_parameters():
        if "ln_" in name or name.endswith(".bias"):
            p.add_(torch.randn_like(p) * 0.1)
model.save_pretrained(os.path.join(out, "lm"), safe_serialization=True)
model.transformer.save_pretrained(os.path.join(out, "base"), safe_serialization=True)

ids = torch.randint(0, config.vocab_size, (2, 20))
with torch.no_grad():
    hidden = model.transformer(ids).last_hidden_state
lengths = torch.tensor([12, 7, 1])
text_ids = torch.zeros(3, 12, dtype=torch.long)
means, lasts = [], []
with torch.no_grad():
    for i, n in enumerate(lengths.tolist()):
        text_ids[i, :n] = torch.randint(1, config.vocab_size, (n,))
        h = model.transformer(text_ids[i:i + 1, :n]).last_hidden_state[0]
        means.append(h.mean(0))
        lasts.append(h[-1])
save_file({"input_ids": ids, "hidden": hidden.contiguous(), "text_ids": text_ids, "text_lengths": lengths,
           "text_mean": torch.stack(means), "text_last": torch.stack(lasts)},
          os.path.join(out, "expected.safetensors"))

broken = os.path.join(out, "broken")
shutil.copytree(os.path.join(out, "lm"), broken)
tensors = load_file(os.path.join(broken, "model.safetensors"))
del tensors["transformer.h.1.mlp.c_fc.bias"]
tensors["transformer.extra"] = torch.zeros(3)
save_file(tensors, os.path.join(broken, "model.safetensors"))

pickled = os.path.join(out, "pickle")
os.makedirs(pickled)
shutil.copy(os.path.join(out, "lm", "config.json"), pickled)
torch.save(model.state_dict(), os.path.join(pickled, "pytorch_model.bin"))
