"""One tiny trained run shared by the checkpoint / generate.py tests of this directory."""
import ml_collections
import pytest

from tests._train_helpers import tiny

RUN_STEPS = 3
RUN_VOCAB = 400  # >= the test tokenizer's 393 ids (tests/fixtures/tokenizer/qwen)


@pytest.fixture(scope="session")
def tiny_l2a_run(tmp_path_factory):
  """configs/tiny.py with scheme L2A (window 4: prompts longer than the window use both
  branches), vocabulary 400, trained RUN_STEPS steps through train.loop.run (checkpoint at
  the end); its data.seq_len is 32. Returns the workdir."""
  from condattn_jax.train import loop
  wd = str(tmp_path_factory.mktemp("tiny_l2a_run"))
  c = tiny(f"steps={RUN_STEPS},seq=32", checkpoint_every=RUN_STEPS)
  c.model.vocab_size = RUN_VOCAB
  c.model.scheme = ml_collections.ConfigDict(dict(name="l2a", window=4, theta=0.5))
  loop.run(c, wd)
  return wd
