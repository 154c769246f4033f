"""A model already in memory (issue 27 item 2): ``isotui.run(model_object, tokenizer=...)``
measures the object where it sits, through the same extraction as the model by name, and gives
the same numbers; its train/eval flags, device and dtype are left as they were; the cache keys
it by its weights; the keywords that load a name are refused with an object."""

from __future__ import annotations

import math

import pytest

import isotui
from isotui.errors import IsotuiError

from .conftest import corpus


@pytest.fixture
def data(tmp_path) -> str:
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(corpus(8)) + "\n", encoding="utf-8")
    return f"text:{path}"


@pytest.fixture
def bert_folder(tmp_path):
    """A tiny random BERT saved with save_pretrained (with MiniLM's tokenizer) into tmp_path."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from isotui.models.naming import bundled_minilm_dir

    torch.manual_seed(1)
    folder = tmp_path / "bert"
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    BertModel(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(bundled_minilm_dir())).save_pretrained(folder)
    return folder


# columns that name the run rather than measure it: the cache key hashes the weights of an
# object, the files of a folder
NOT_MEASURED = ("run_key",)


def assert_same_rows(mine: list[dict], theirs: list[dict]) -> None:
    """Every CSV column equal (floats to 1e-9, NaN where NaN), but the cache key."""
    assert len(mine) == len(theirs) and mine
    for a, b in zip(mine, theirs, strict=True):
        assert list(a) == list(b)
        for column in a:
            if column in NOT_MEASURED:
                continue
            x, y = a[column], b[column]
            if isinstance(y, float) and not isinstance(x, bool):
                assert (math.isnan(x) and math.isnan(y)) or abs(x - y) <= 1e-9, (column, x, y)
            else:
                assert x == y, (column, x, y)


def test_a_model_object_equals_the_model_by_name(bert_folder, data):
    import torch
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(bert_folder))
    tok = AutoTokenizer.from_pretrained(str(bert_folder))
    model.train()  # a training loop's model: it goes on training afterwards
    model.encoder.layer[0].eval()  # one module in eval mode: each flag comes back as it was
    modes = [m.training for m in model.modules()]
    pointers = [p.data_ptr() for p in model.parameters()]
    by_name = isotui.run(str(bert_folder), data=data, cache=False)
    obj = isotui.run(model, data=data, tokenizer=tok, cache=False)
    assert obj.models == [str(bert_folder)]  # named after the folder it was loaded from
    assert_same_rows(obj.rows, by_name.rows)
    assert any("object in memory" in n for n in obj.result.meta["notes"])
    assert [m.training for m in model.modules()] == modes
    assert [p.data_ptr() for p in model.parameters()] == pointers  # not copied, moved or cast
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_plain_module_by_its_call_convention(bert_folder, data):
    """A torch.nn.Module returning its hidden states (layer 0 first) is measured as the model
    inside it by name."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = AutoModel.from_pretrained(str(bert_folder))

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)[
                "hidden_states"
            ]

    by_name = isotui.run(str(bert_folder), data=data, cache=False)
    tok = AutoTokenizer.from_pretrained(str(bert_folder))
    # a plain module has no config to give its positions: its max length is the tokenizer's (<= 512)
    obj = isotui.run(Encoder(), data=data, tokenizer=tok, name=str(bert_folder), max_length=128, cache=False)
    assert_same_rows(obj.rows, by_name.rows)
    with pytest.raises(IsotuiError, match=r"plain torch\.nn\.Module: give tokenizer="):
        isotui.run(Encoder(), data=data)

    class Wrong(Encoder):
        def forward(self, input_ids, attention_mask):
            return super().forward(input_ids, attention_mask)[-1]

    with pytest.raises(IsotuiError, match="must return its hidden states"):
        isotui.run(Wrong(), data=data, tokenizer=tok, cache=False)


def test_a_timm_object_equals_the_model_by_name():
    import timm
    import torch

    name = "random:timm:vit_tiny_patch16_224:depth=2"
    by_name = isotui.run(name, data="synthetic:images", max_samples=3, cache=False)
    torch.manual_seed(0)  # as the name's random init is seeded
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2)
    obj = isotui.run(model, data="synthetic:images", max_samples=3, name=name, cache=False)
    assert_same_rows(obj.rows, by_name.rows)


def test_the_cache_keys_an_object_by_its_weights(bert_folder, data):
    import torch
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(bert_folder))
    tok = AutoTokenizer.from_pretrained(str(bert_folder))
    first = isotui.run(model, data=data, tokenizer=tok)
    again = isotui.run(model, data=data, tokenizer=tok)
    assert again.result.from_cache and again.key == first.key
    twin = AutoModel.from_pretrained(str(bert_folder))  # another object, the same weights
    assert isotui.run(twin, data=data, tokenizer=tok).result.from_cache
    with torch.no_grad():
        model.encoder.layer[1].output.dense.weight[0, 0] += 1e-6  # one weight, barely
    changed = isotui.run(model, data=data, tokenizer=tok)
    assert not changed.result.from_cache and changed.key != first.key
    assert changed.rows[-1]["avg_cos"] != first.rows[-1]["avg_cos"]


@pytest.mark.parametrize(
    ("keyword", "value"),
    [
        ("dtype", "float16"),
        ("device", "cpu"),
        ("device_map", "auto"),
        ("trust_remote_code", True),
        ("shard", "0/2"),
    ],
)
def test_loading_keywords_are_refused_with_an_object(bert_folder, data, keyword, value):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(bert_folder))
    tok = AutoTokenizer.from_pretrained(str(bert_folder))
    with pytest.raises(IsotuiError, match=rf"^{keyword}= does not apply to a model object: "):
        isotui.run(model, data=data, tokenizer=tok, **{keyword: value})


def test_what_an_object_needs_is_said(bert_folder, data):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(bert_folder))
    with pytest.raises(IsotuiError, match=r"reads text: give its tokenizer as tokenizer="):
        isotui.run(model, data=data)
    with pytest.raises(IsotuiError, match="processor= goes with a model object"):
        isotui.run(str(bert_folder), data=data, processor=object())
    with pytest.raises(
        IsotuiError, match=r"model must be a model name, a list of names or a torch\.nn\.Module"
    ):
        isotui.run(42, data=data)


def test_an_experiment_takes_a_model_object(bert_folder, data):
    """attention on the object equals attention on the name (the same request path)."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(bert_folder))
    tok = AutoTokenizer.from_pretrained(str(bert_folder))
    by_name = isotui.experiment("attention", model=str(bert_folder), data=data, cache=False)
    obj = isotui.experiment("attention", model=model, tokenizer=tok, data=data, cache=False)
    assert len(obj.rows) == len(by_name.rows)
    for a, b in zip(obj.rows, by_name.rows, strict=True):
        for column, y in b.items():
            if isinstance(y, float) and math.isfinite(y):
                assert abs(a[column] - y) <= 1e-9, column
    with pytest.raises(IsotuiError, match="takes model names, not a model object"):
        isotui.experiment("checkpoints", model=model, checkpoints=["a", "b"])


def test_gradients_take_a_language_model_object(tmp_path, data):
    """The gradient experiment on a masked-LM object equals it on the folder; a bare encoder
    object (no head) is refused in one sentence; the object's parameters get no .grad."""
    import torch
    from transformers import AutoModel, AutoTokenizer, BertConfig, BertForMaskedLM

    from isotui.models.naming import bundled_minilm_dir

    torch.manual_seed(2)
    folder = tmp_path / "mlm"
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    BertForMaskedLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(bundled_minilm_dir())).save_pretrained(folder)
    model = BertForMaskedLM.from_pretrained(str(folder))
    tok = AutoTokenizer.from_pretrained(str(folder))
    by_name = isotui.experiment("gradients", model=str(folder), data=data, cache=False)
    obj = isotui.experiment("gradients", model=model, tokenizer=tok, data=data, cache=False)
    assert_same_rows(obj.rows, by_name.rows)
    # processor= (None for a text model, as a training callback passes it) is the object's too
    kept = isotui.experiment("gradients", model=model, tokenizer=tok, processor=None, data=data, cache=False)
    assert_same_rows(kept.rows, by_name.rows)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(IsotuiError, match="has no language-model head: give the AutoModelForMaskedLM"):
        isotui.experiment("gradients", model=AutoModel.from_pretrained(str(folder)), tokenizer=tok, data=data)


def test_no_weight_is_hashed_without_a_cache(bert_folder, data, monkeypatch):
    """``cache=False``: no fingerprint of the weights is made (the hashing of the state dict is
    never called); with the cache, an object's weights are hashed once for its key."""
    from transformers import AutoModel, AutoTokenizer

    from isotui.models import given

    hashed: list[str] = []
    real = given._hash_tensors

    def counted(h, model, name):
        hashed.append(name)
        real(h, model, name)

    monkeypatch.setattr(given, "_hash_tensors", counted)
    model = AutoModel.from_pretrained(str(bert_folder))
    tok = AutoTokenizer.from_pretrained(str(bert_folder))
    isotui.run(model, data=data, tokenizer=tok, cache=False)
    isotui.experiment("token-types", model=model, tokenizer=tok, data=data, top=2, cache=False)
    assert hashed == []
    isotui.run(model, data=data, tokenizer=tok)  # the cache keys it by its weights: one hash
    assert hashed == [str(bert_folder)]


def test_torch_threads_come_back_after_a_run_on_an_object(bert_folder, data):
    """A run on an object sets torch's threads for itself (``threads=``) and gives the process
    its own count back afterwards, as it gives the model its train/eval flags."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(bert_folder))
    tok = AutoTokenizer.from_pretrained(str(bert_folder))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        seen: list[int] = []
        model.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
        isotui.run(model, data=data, tokenizer=tok, threads=1, cache=False)
        assert seen and set(seen) == {1}  # the run's own count while it ran
        assert torch.get_num_threads() == 2
        isotui.experiment("token-types", model=model, tokenizer=tok, data=data, threads=1, cache=False)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
