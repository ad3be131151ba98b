"""Tokenizers (runner.tokenizers) and chat rendering (runner.chat): the character tokenizer, a
Hugging Face tokenizer.json built here with the `tokenizers` library and its chat template."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runner.chat import ConcatRenderer, TemplateRenderer, renderer_for
from runner.env import tokenizer as tok
from runner.tokenizers import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer

CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is 2+2?"},
    {"role": "assistant", "content": "let me check"},
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "it is 4"},
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json trained here, with ChatML specials and template."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [m["content"] for m in CONVERSATION] * 20 + ["the quick brown fox", "system user"]
    hf.train_from_iterator(corpus, trainer)
    d = tmp_path_factory.mktemp("hf")
    hf.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "pad_token": {"content": "<|endoftext|>"},
                "chat_template": CHATML,
            }
        )
    )
    return d


def test_char_tokenizer_is_the_builtin_one():
    t = CharTokenizer()
    assert isinstance(t, Tokenizer)
    assert (t.vocab_size, t.bos_id, t.eos_id, t.pad_id) == (tok.VOCAB_SIZE, 1, 2, 0)
    assert t.stop_token_ids == (tok.NEWLINE_ID, tok.EOS_ID) and t.chat_template is None
    ids, starts = t.encode_with_offsets("ans 7\n")
    assert t.decode(ids) == "ans 7\n" and starts == list(range(6))
    assert load_tokenizer("", "none").name == "chars"
    with pytest.raises(ValueError, match="chat_template needs a Hugging Face tokenizer"):
        load_tokenizer("", "x.jinja")
    r = renderer_for(t)
    assert isinstance(r, ConcatRenderer)
    tokens, weights = r.render(
        [{"role": "user", "content": "q\n"}, {"role": "assistant", "content": "a\n"}],
        train_on="all_assistant",
    )
    assert tok.decode(tokens) == "<bos>q\na\n" and weights.tolist() == [0, 0, 0, 1, 1]


@given(st.text(alphabet=st.sampled_from(list("abcxyz 24?+\nå日")), max_size=40))
def test_hf_tokenizer_round_trips(hf_dir, text):
    t = load_tokenizer(str(hf_dir))
    ids = t.encode(text)
    assert all(0 <= i < t.vocab_size for i in ids)
    assert t.decode(ids) == text


def test_hf_tokenizer_reads_its_config(hf_dir, tmp_path):
    t = load_tokenizer(str(hf_dir / "tokenizer.json"))
    assert isinstance(t, HFTokenizer) and isinstance(t, Tokenizer)
    assert t.eos_id == t._tok.token_to_id("<|im_end|>") and t.bos_id is None
    assert t.pad_id == t._tok.token_to_id("<|endoftext|>") and t.stop_token_ids == (t.eos_id,)
    assert t.chat_template == CHATML and isinstance(renderer_for(t), TemplateRenderer)
    assert load_tokenizer(str(hf_dir), "none").chat_template is None
    with pytest.raises(ValueError, match="no tokenizer.json at"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        t.decode([t.vocab_size])


@pytest.mark.parametrize("train_on", ["all_assistant", "last_assistant"])
def test_chat_template_assistant_masks(hf_dir, train_on):
    t = load_tokenizer(str(hf_dir))
    tokens, weights = renderer_for(t).render(CONVERSATION, train_on=train_on)
    text = t.decode(tokens.tolist())
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>\n")
    assistant = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    want = assistant if train_on == "all_assistant" else assistant[-1:]
    # trained tokens, decoded span by span: each assistant content and its end-of-turn
    spans, cur = [], []
    for i, w in zip(tokens.tolist(), weights.tolist(), strict=True):
        if w:
            cur.append(i)
        elif cur:
            spans.append(t.decode(cur))
            cur = []
    if cur:
        spans.append(t.decode(cur))
    assert spans == [c + "<|im_end|>\n" for c in want]
    assert weights[0] == 0.0


def test_chat_template_tokens_match_transformers(hf_dir):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    fast.chat_template = CHATML
    ref = fast.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    t = load_tokenizer(str(hf_dir))
    tokens, weights = renderer_for(t).render(CONVERSATION, train_on="all_assistant")
    assert tokens.tolist() == list(ref["input_ids"])
    # transformers' {% generation %} mask is the content and <|im_end|>; ours adds the newline
    # the template writes after it (the prefix difference) and nothing else.
    hf_mask = np.asarray(ref["assistant_masks"], bool)
    ours = weights > 0
    assert np.all(ours[hf_mask]) and set(t.decode(tokens[ours & ~hf_mask].tolist())) <= {"\n"}
    prompt = renderer_for(t).prompt(CONVERSATION[:2])
    assert prompt == list(
        fast.apply_chat_template(
            CONVERSATION[:2], tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
    )


def test_a_template_that_rewrites_history_cannot_give_all_assistant_masks(hf_dir):
    t = load_tokenizer(str(hf_dir))
    rewriting = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|im_start|>"
        "assistant\n(earlier)<|im_end|>\n{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + "
        "m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    r = TemplateRenderer(t, rewriting)
    with pytest.raises(ValueError, match=r"messages\[2\]: the chat template does not render"):
        r.render(CONVERSATION, train_on="all_assistant")
    tokens, weights = r.render(CONVERSATION, train_on="last_assistant")
    assert t.decode(tokens[weights > 0].tolist()) == "it is 4<|im_end|>\n"
    with pytest.raises(ValueError, match="does not parse"):
        TemplateRenderer(t, "{% for %}")
    with pytest.raises(ValueError, match="the chat template failed: no"):
        TemplateRenderer(t, "{{ raise_exception('no') }}").render(
            CONVERSATION, train_on="all_assistant"
        )


def test_sft_with_a_hugging_face_tokenizer_end_to_end(hf_dir, tmp_path):
    """`python -m runner sft` on a JSONL through the chat template (no task, HF vocabulary)."""
    from runner.config import load_config
    from runner.train import run

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": CONVERSATION}) + "\n" for _ in range(6)))
    cfg = load_config(
        None,
        [
            f'run.output_dir="{tmp_path}"',
            f'tokenizer.path="{hf_dir}"',
            'task.factory=""',
            f'sft.data="{data}"',
            "sft.steps=3",
            "sft.batch_size=4",
            "rl.steps=0",
            "model.d_model=16",
            "model.n_heads=2",
            "model.n_layers=1",
            "model.d_ff=32",
            "checkpoint.interval=0",
        ],
    )
    result = run(cfg, progress=False)
    sft = [r for r in result.metrics if r["phase"] == "sft"]
    assert len(sft) == 3 and all(math.isfinite(r["sft/nll"]) for r in sft)
    assert "eval_reward" not in result.metrics[0]  # no task: no reward evaluation
