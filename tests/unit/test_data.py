"""The default corpus, its tokenizer, and layout-independent global batches."""

import json
import pickle

import pytest
import torch
from torchtitan.components.tokenizer import HuggingFaceTokenizer

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from tests.run_configs import run_from_args
from titan_hybrid.data.build_tokenizer import write_tokenizer
from titan_hybrid.data.corpus import TOKENIZER_DIR, pydoc_documents
from titan_hybrid.data.loader import GlobalBatchTextLoader
from titan_hybrid.data.tokenizer import resolve_assets_path


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer(tokenizer_path=str(TOKENIZER_DIR))


def make_loader(tokenizer, *, dp_rank, dp_world_size, local_batch_size, seq_len=32,
                documents=None):
    docs = documents if documents is not None else pydoc_documents()[:12]
    return GlobalBatchTextLoader(documents=lambda: docs, text_of=lambda t: t,
                                 tokenizer=tokenizer, seq_len=seq_len,
                                 local_batch_size=local_batch_size, dp_rank=dp_rank,
                                 dp_world_size=dp_world_size)


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_corpus_is_real_documentation_text():
    docs = pydoc_documents()
    assert len(docs) > 50 and sum(map(len, docs)) > 300_000
    assert any("The " in d and "statement" in d for d in docs)


def test_committed_tokenizer_matches_the_build_script(tmp_path):
    write_tokenizer(tmp_path)
    written, committed = tmp_path / "tokenizer.json", TOKENIZER_DIR / "tokenizer.json"
    assert written.read_bytes() == committed.read_bytes()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == json.loads(
        (TOKENIZER_DIR / "tokenizer_config.json").read_text())


def test_tokenizer_round_trips_text_with_bos_eos(tokenizer):
    text = "The for statement is used to iterate over the elements of a sequence."
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.decode(ids[1:-1]) == text
    assert tokenizer.get_vocab_size() == 2048
    # Real BPE merges: far fewer tokens than bytes.
    assert len(ids) < len(text) / 2.5


def test_assets_path_resolves_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_assets_path("titan_hybrid/assets/pydoc_bpe") == TOKENIZER_DIR
    with pytest.raises(ValueError, match="model.hf_assets_path 'nowhere'"):
        resolve_assets_path("nowhere")


def test_global_batches_are_identical_for_dp_1_and_2(tokenizer):
    # Global batch 8 per step: dp=1 takes it as 2 microbatches of 4; dp=2 as one batch of 4
    # per rank (each rank's two-microbatch view would also be checked below).
    single = take(make_loader(tokenizer, dp_rank=0, dp_world_size=1, local_batch_size=4), 6)
    ranks = [take(make_loader(tokenizer, dp_rank=r, dp_world_size=2, local_batch_size=2), 6)
             for r in range(2)]
    for step in range(6):
        global_from_ranks = torch.cat([ranks[r][step][0]["input"] for r in range(2)])
        assert torch.equal(global_from_ranks, single[step][0]["input"])
        labels = torch.cat([ranks[r][step][1] for r in range(2)])
        assert torch.equal(labels, single[step][1])
    inputs, labels = single[0][0]["input"], single[0][1]
    assert inputs.shape == (4, 32) and labels.shape == (4, 32)
    # labels are the inputs shifted by one token
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_state_resumes_by_global_position_under_another_layout(tokenizer):
    uninterrupted = take(make_loader(tokenizer, dp_rank=0, dp_world_size=1,
                                     local_batch_size=4), 7)
    first = make_loader(tokenizer, dp_rank=1, dp_world_size=2, local_batch_size=2)
    take(first, 3)
    state = first.state_dict()
    # The state is rank-independent: rank 0 would save the same bytes.
    other_rank = make_loader(tokenizer, dp_rank=0, dp_world_size=2, local_batch_size=2)
    take(other_rank, 3)
    assert other_rank.state_dict() == state

    resumed = make_loader(tokenizer, dp_rank=0, dp_world_size=1, local_batch_size=4)
    resumed.load_state_dict(state)
    for expected, got in zip(uninterrupted[3:], take(resumed, 4)):
        assert torch.equal(expected[0]["input"], got[0]["input"])


def test_loader_reloops_and_tracks_epochs(tokenizer):
    docs = pydoc_documents()[:2]
    loader = make_loader(tokenizer, dp_rank=0, dp_world_size=1, local_batch_size=8,
                         seq_len=64, documents=docs)
    n_tokens = sum(len(tokenizer.encode(d, add_bos=True, add_eos=True)) for d in docs)
    steps = n_tokens // (8 * 65) + 3
    take(loader, steps)
    assert pickle.loads(loader.state_dict()["global_text_position"])["epoch"] >= 1


def test_bad_state_is_a_clear_error(tokenizer):
    loader = make_loader(tokenizer, dp_rank=0, dp_world_size=1, local_batch_size=2)
    with pytest.raises(ValueError, match="global_text_position"):
        loader.load_state_dict({"dp_rank_0": b""})
    with pytest.raises(ValueError, match="dp_rank 2"):
        make_loader(tokenizer, dp_rank=2, dp_world_size=2, local_batch_size=2)


def test_torchtitan_hf_dataset_by_name_and_path(tmp_path, tokenizer):
    from titan_hybrid.data.loader import build_global_batch_dataloader

    texts = [f"Document number {i} talks about layers, experts and state spaces." * 3
             for i in range(40)]
    (tmp_path / "data.json").write_text(
        "\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    job = run_from_args("--training.dataset", "c4_test", "--training.dataset_path",
                        str(tmp_path), "--training.seq_len", "16",
                        "--training.local_batch_size", "2")
    loader = build_global_batch_dataloader(1, 0, tokenizer, job.data, job.training)
    inputs = next(iter(loader))[0]["input"]
    assert inputs.shape == (2, 16)
    expected = tokenizer.encode(texts[0], add_bos=True, add_eos=True)[:16]
    assert inputs[0].tolist() == expected


def test_split_holds_out_every_tenth_document():
    from titan_hybrid.data.corpus import pydoc_split

    docs, train, held_out = pydoc_documents(), pydoc_split("train"), pydoc_split("validation")
    assert held_out == docs[::10] and len(held_out) == 8
    # Topics "else" (index 30, held out) and "if" (41) have the same text: both leave training.
    assert docs[30] == docs[41]
    assert train == tuple(d for i, d in enumerate(docs) if i % 10 and i != 41)
    assert not set(train) & set(held_out)
    with pytest.raises(ValueError, match="pydoc split 'test'"):
        pydoc_split("test")


def _stream(loader, passes_over: int):
    """Tokens of the loader's windows, in order, until `passes_over` tokens are covered."""
    tokens = []
    for inputs, labels in loader:
        for row_in, row_lab in zip(inputs["input"].tolist(), labels.tolist()):
            tokens += row_in + row_lab[-1:]
        if len(tokens) >= passes_over:
            break
    return tokens


def test_training_stream_never_contains_held_out_documents(tokenizer):
    from titan_hybrid.data.corpus import pydoc_split
    from titan_hybrid.data.loader import (
        build_global_batch_dataloader,
        build_validation_dataloader,
    )

    job = run_from_args("--training.dataset", "pydoc", "--training.seq_len", "255",
                        "--training.local_batch_size", "4", "--validation.seq_len", "63",
                        "--validation.local_batch_size", "2")
    encode = lambda docs: [t for d in docs for t in tokenizer.encode(d, add_bos=True,  # noqa
                                                                      add_eos=True)]
    train_tokens, held_tokens = encode(pydoc_split("train")), encode(pydoc_split("validation"))
    # One full pass of training windows is exactly the training documents' token stream,
    stream = _stream(build_global_batch_dataloader(1, 0, tokenizer, job.data, job.training),
                     len(train_tokens))
    epoch = len(train_tokens) // 1024 * 1024
    assert stream[:epoch] == train_tokens[:epoch]
    # ... so no stretch of a held-out document appears in it.
    text = "," + ",".join(map(str, stream)) + ","
    for doc in pydoc_split("validation"):
        ids = tokenizer.encode(doc, add_bos=False, add_eos=False)[:24]
        assert "," + ",".join(map(str, ids)) + "," not in text
    # The validation loader reads exactly the held-out documents, the same windows each pass.
    loader = build_validation_dataloader(2, 1, tokenizer, job.validation, job.data)
    first = [labels for _, labels in loader]
    loader.restart()
    again = [labels for _, labels in loader]
    assert len(first) == len(held_tokens) // (2 * 2 * 64) and len(first) > 10
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    rank1_first_window = held_tokens[2 * 64:3 * 64]
    assert first[0][0].tolist() == rank1_first_window[1:]
