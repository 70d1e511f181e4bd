"""A dense run exported by ``nedolm-sft export`` is a working Hugging Face Llama model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

from nedolm.data.inputs import read_records
from nedolm.data.records import ROLE_ASSISTANT, ROLE_NAMES, ROLE_SYSTEM
from nedolm.data.render import ConversationLayout, chat_template
from nedolm.data.sources import Conversation, RecordPolicy, parse_record
from nedolm.data.tokenizer import build_special_tokens
from nedolm.model import generate
from nedolm_sft.chat_model import load_chat_model

PROMPT = "Türkiye'nin başkenti neresidir?"
FIXTURES = Path(__file__).parents[1] / "packages" / "nedolm-data" / "tests" / "fixtures"
TR_CHAT = FIXTURES / "tr_chat"
TOOL_CHAT = FIXTURES / "tool_chat" / "glaive_toolcall_en_demo.jsonl"


def nedolm_sft(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nedolm_sft", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def exported(dense_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "hf"
    result = nedolm_sft("export", str(dense_run), "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


def test_export_loads_in_transformers_with_the_same_logits(dense_run: Path, exported: Path) -> None:
    ours = load_chat_model(dense_run).model.eval()
    theirs = LlamaForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, our_logits = ours(ids, return_logits=True)
        their_logits = theirs(ids).logits
    assert their_logits.shape[-1] == ours.cfg.vocab_size
    diff = (our_logits[..., : ours.cfg.vocab_size] - their_logits).abs().max().item()
    assert diff <= 1e-4, diff


def test_generate_equals_transformers_greedy_decoding(dense_run: Path, exported: Path) -> None:
    chat = load_chat_model(exported)
    prompt = chat.render([("user", PROMPT)])
    stops = (chat.specials.message_end_id, chat.specials.eos_id)
    ours = list(generate(chat.model, prompt, max_new_tokens=24, stop_ids=stops))
    theirs_model = LlamaForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).eval()
    out = theirs_model.generate(
        torch.tensor([prompt]),
        max_new_tokens=24,
        do_sample=False,
        eos_token_id=[chat.specials.message_end_id, chat.specials.eos_id],
        pad_token_id=chat.specials.pad_id,
    )
    theirs = out[0, len(prompt) :].tolist()
    if theirs and theirs[-1] in (chat.specials.message_end_id, chat.specials.eos_id):
        theirs = theirs[:-1]
    assert ours == theirs
    assert len(ours) > 0

    result = nedolm_sft("generate", str(exported), "--prompt", PROMPT, "--max-new-tokens", "24")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == chat.tokenizer.decode(ours).strip()


def test_exported_tokenizer_encodes_the_control_tokens_at_corpus_ids(exported: Path) -> None:
    chat = load_chat_model(exported)
    hf = AutoTokenizer.from_pretrained(exported)
    ids = hf.encode("<|mesaj_basla|>", add_special_tokens=False)
    assert ids == [chat.specials.message_start_id]
    assert hf.convert_tokens_to_ids("<|mesaj_bitir|>") == chat.specials.message_end_id
    assert hf.eos_token_id == chat.specials.eos_id
    text = hf.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    assert text == f"<|mesaj_basla|>kullanici\n{PROMPT}<|mesaj_bitir|><|mesaj_basla|>asistan\n"


def fixture_conversations() -> list[Conversation]:
    """Every record of the shipped Turkish fixtures, parsed as the builder parses them."""
    return [
        parse_record(raw, path.name, line, RecordPolicy())
        for path in sorted(TR_CHAT.glob("*.jsonl"))
        for line, raw in read_records(path)
    ]


def test_chat_template_tokenizes_to_the_renderer_ids_on_real_records(exported: Path) -> None:
    """transformers' apply_chat_template with the exported tokenizer == the corpus renderer."""
    chat = load_chat_model(exported)
    hf = PreTrainedTokenizerFast.from_pretrained(exported)
    conversations = fixture_conversations()
    assert len(conversations) >= 50
    assert sum(c.messages[0].role == ROLE_SYSTEM for c in conversations) >= 10
    assert sum(sum(m.role == ROLE_ASSISTANT for m in c.messages) > 1 for c in conversations) >= 10
    for conv in conversations:
        roles = [ROLE_NAMES[m.role] for m in conv.messages]
        texts = [m.text for m in conv.messages]
        contents = chat.tokenizer.encode_batch(texts)
        messages = [{"role": r, "content": t} for r, t in zip(roles, texts, strict=True)]

        full = hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert full == chat.layout.document(roles, contents), conv.doc_key

        # Generation: the conversation up to its last assistant turn, then an open turn.
        last = max(i for i, r in enumerate(roles) if r == "assistant")
        prompt = hf.apply_chat_template(
            messages[:last], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        assert prompt == chat.render(list(zip(roles[:last], texts[:last], strict=True)))
        assert prompt == chat.layout.prompt(roles[:last], contents[:last])


def test_chat_template_refuses_an_unknown_role(exported: Path) -> None:
    hf = PreTrainedTokenizerFast.from_pretrained(exported)
    with pytest.raises(Exception, match="unknown role: tool"):
        hf.apply_chat_template([{"role": "tool", "content": "{}"}], tokenize=False)


def test_chat_template_renders_tool_calls_and_tools_like_the_builder(exported: Path) -> None:
    """tool_chat records: apply_chat_template(messages, tools=...) == parse_record + renderer,
    with the template a tool-registering corpus exports (role ``tool`` in its registry)."""
    chat = load_chat_model(exported)
    hf = PreTrainedTokenizerFast.from_pretrained(exported)
    specials = build_special_tokens(chat.tokenizer, "tokenizer.json")
    assert "tool" in specials.roles
    hf.chat_template = chat_template(hf.eos_token, specials.roles)
    layout = ConversationLayout.from_specials(specials)
    records = [json.loads(line) for line in TOOL_CHAT.read_text(encoding="utf-8").splitlines()]
    assert sum(bool(r.get("tools")) for r in records) >= 3
    assert sum(any(m["role"] == "tool" for m in r["messages"]) for r in records) >= 3
    for n, record in enumerate(records, start=1):
        conv = parse_record(json.dumps(record).encode(), TOOL_CHAT.name, n, RecordPolicy())
        assert isinstance(conv, Conversation), conv
        roles = [ROLE_NAMES[m.role] for m in conv.messages]
        contents = chat.tokenizer.encode_batch([m.text for m in conv.messages])
        full = hf.apply_chat_template(
            record["messages"], tools=record.get("tools"), tokenize=True, return_dict=True
        )["input_ids"]
        assert full == layout.document(roles, contents), n


def test_repetition_penalty_and_placement_options_of_generate(exported: Path) -> None:
    """--repetition-penalty gives transformers' generate(repetition_penalty=...) reply."""
    chat = load_chat_model(exported)
    prompt = chat.render([("user", PROMPT)])
    stops = [chat.specials.message_end_id, chat.specials.eos_id]
    theirs_model = LlamaForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).eval()
    out = theirs_model.generate(
        torch.tensor([prompt]),
        max_new_tokens=24,
        do_sample=False,
        repetition_penalty=3.0,
        eos_token_id=stops,
        pad_token_id=chat.specials.pad_id,
    )
    theirs = [t for t in out[0, len(prompt) :].tolist() if t not in stops]
    args = ("generate", str(exported), "--prompt", PROMPT, "--max-new-tokens", "24")
    result = nedolm_sft(*args, "--repetition-penalty", "3.0", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == chat.tokenizer.decode(theirs).strip()
    plain = nedolm_sft(*args)
    assert plain.stdout != result.stdout  # the penalty changed this reply

    half = nedolm_sft(*args, "--dtype", "bfloat16")
    assert half.returncode == 0 and half.stdout.strip(), half.stderr
    wrong = nedolm_sft(*args, "--device", "tpu:9")
    assert wrong.returncode == 2 and "--device tpu:9" in wrong.stderr
