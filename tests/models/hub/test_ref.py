"""models.hub.ref: the references people type, quant tags, split GGUFs, and which file a reference picks."""
from __future__ import annotations

import pytest

from models.hub.ref import DEFAULT_QUANT, HubFile, HubRef, RefError, choose, group_files, parse_ref, quant_tag, split_part


@pytest.mark.parametrize("text, expected", [
    ("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", HubRef("bartowski/Llama-3.2-1B-Instruct-GGUF", "", "Q4_K_M")),
    ("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:q8_0", HubRef("bartowski/Llama-3.2-1B-Instruct-GGUF", "", "Q8_0")),
    ("HF.CO/Qwen/Qwen2.5-0.5B-Instruct-GGUF", HubRef("Qwen/Qwen2.5-0.5B-Instruct-GGUF")),
    ("huggingface.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf",
     HubRef("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q4_k_m.gguf")),
    ("https://huggingface.co/unsloth/gemma-3-1b-it-GGUF/blob/main/gemma-3-1b-it-Q4_K_M.gguf",
     HubRef("unsloth/gemma-3-1b-it-GGUF", "gemma-3-1b-it-Q4_K_M.gguf")),
    ("https://huggingface.co/o/r/resolve/abc123/sub/dir/m-Q8_0.gguf?download=true",
     HubRef("o/r", "sub/dir/m-Q8_0.gguf", "", "abc123")),
    ("  hf.co/o/r/  ", HubRef("o/r")),
])
def test_parse_ref_forms(text, expected):
    assert parse_ref(text) == expected


@pytest.mark.parametrize("text, words", [
    ("bartowski/Llama-3.2-1B-Instruct-GGUF", "not a Hub reference"),
    ("hf.co/onlyowner", "names no repo"),
    ("hf.co/o/r:", "empty quant tag"),
    ("hf.co/o/r/README.md", "not a .gguf file"),
    ("hf.co/o/r/../../etc/passwd.gguf", "not a file path inside a repo"),
    ("hf.co/../r", "not a valid name"),
    ("hf.co/o/r/tree/main", "is a folder of the repo"),
])
def test_parse_ref_refuses_in_one_line(text, words):
    with pytest.raises(RefError) as info:
        parse_ref(text)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert info.value.kind == "ref"


def test_str_round_trips():
    for text in ("hf.co/o/r:Q4_K_M", "hf.co/o/r/f-Q8_0.gguf", "hf.co/o/r"):
        assert str(parse_ref(text)) == text


@pytest.mark.parametrize("name, tag", [
    ("Qwen2.5-1.5B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
    ("qwen2.5-0.5b-instruct-q4_k_m.gguf", "Q4_K_M"),
    ("Llama-3.2-1B-Instruct-IQ4_XS.gguf", "IQ4_XS"),
    ("SmolLM2-360M-Instruct.Q8_0.gguf", "Q8_0"),
    ("gemma-3-1b-it-BF16.gguf", "BF16"),
    ("Qwen3-4B-UD-Q4_K_XL.gguf", "UD-Q4_K_XL"),
    ("sub/Meta-Llama-3.1-8B-Instruct-Q6_K-00002-of-00003.gguf", "Q6_K"),
    ("Phi-3.5-mini-instruct.gguf", ""),
    ("Qwen3-4B.gguf", ""),
])
def test_quant_tag(name, tag):
    assert quant_tag(name) == tag


def test_split_part():
    assert split_part("m-Q8_0-00002-of-00003.gguf") == (2, 3)
    assert split_part("m-Q8_0.gguf") is None


def files(*names_sizes):
    return [HubFile(n, s, f"{i:064x}") for i, (n, s) in enumerate(names_sizes)]


REPO = files(("m-Q2_K.gguf", 100), ("m-Q4_K_M.gguf", 300), ("m-Q4_K_S.gguf", 280), ("m-Q4_K_L.gguf", 320),
             ("m-IQ4_XS.gguf", 250), ("m-Q8_0.gguf", 600),
             ("Q8_0-big/m-F16-00001-of-00002.gguf", 700), ("Q8_0-big/m-F16-00002-of-00002.gguf", 500),
             ("mmproj-m-f16.gguf", 90), ("README.md", 5), ("m-imatrix.gguf", 3))


def test_group_files_keeps_models_and_groups_split_parts():
    ggufs = group_files(REPO)
    assert [(g.name, g.quant, g.size_bytes, len(g.parts)) for g in ggufs] == [
        ("m-Q2_K.gguf", "Q2_K", 100, 1), ("m-IQ4_XS.gguf", "IQ4_XS", 250, 1), ("m-Q4_K_S.gguf", "Q4_K_S", 280, 1),
        ("m-Q4_K_M.gguf", "Q4_K_M", 300, 1), ("m-Q4_K_L.gguf", "Q4_K_L", 320, 1), ("m-Q8_0.gguf", "Q8_0", 600, 1),
        ("Q8_0-big/m-F16-00001-of-00002.gguf", "F16", 1200, 2)]
    # A split model missing a part is left out.
    assert all(not g.split for g in group_files(REPO[:-5] + REPO[-4:]))


@pytest.mark.parametrize("ref, name", [
    ("hf.co/o/r:Q4_K_M", "m-Q4_K_M.gguf"),
    ("hf.co/o/r:q4_k_s", "m-Q4_K_S.gguf"),
    ("hf.co/o/r:iq4_xs", "m-IQ4_XS.gguf"),
    ("hf.co/o/r", "m-Q4_K_M.gguf"),        # no tag: Q4_K_M
    ("hf.co/o/r/m-Q8_0.gguf", "m-Q8_0.gguf"),
    ("hf.co/o/r:F16", "Q8_0-big/m-F16-00001-of-00002.gguf"),
    ("hf.co/o/r/Q8_0-big/m-F16-00002-of-00002.gguf", "Q8_0-big/m-F16-00001-of-00002.gguf"),
])
def test_choose(ref, name):
    assert choose(group_files(REPO), parse_ref(ref)).name == name


def test_choose_prefers_the_catalog_file_without_a_tag():
    assert choose(group_files(REPO), parse_ref("hf.co/o/r"), preferred="m-Q8_0.gguf").name == "m-Q8_0.gguf"
    assert choose(group_files(REPO), parse_ref("hf.co/o/r:Q2_K"), preferred="m-Q8_0.gguf").name == "m-Q2_K.gguf"


def test_choose_a_repo_with_one_untagged_file():
    only = group_files(files(("Phi-3.5-mini-instruct.gguf", 10)))
    assert choose(only, parse_ref("hf.co/o/r")).name == "Phi-3.5-mini-instruct.gguf"
    with pytest.raises(RefError, match="has no Q8_0 file"):
        choose(only, parse_ref("hf.co/o/r:Q8_0"))


def test_choose_failures_list_what_there_is():
    with pytest.raises(RefError) as info:
        choose(group_files(REPO), parse_ref("hf.co/o/r:Q3_K_M"))
    assert str(info.value) == ("hf.co/o/r has no Q3_K_M file; it has F16, IQ4_XS, Q2_K, Q4_K_L, Q4_K_M, Q4_K_S, "
                               "Q8_0: pick one as hf.co/o/r:TAG (`attnchat models files` lists them with sizes)")
    with pytest.raises(RefError, match="has no file 'nope.gguf'"):
        choose(group_files(REPO), parse_ref("hf.co/o/r/nope.gguf"))
    with pytest.raises(RefError, match="has no GGUF model files"):
        choose([], parse_ref("hf.co/o/r"))
    two = group_files(files(("a/m-Q4_K_M.gguf", 1), ("b/m-Q4_K_M.gguf", 2)))
    with pytest.raises(RefError, match=r"matches 2 files \(a/m-Q4_K_M.gguf, b/m-Q4_K_M.gguf\)"):
        choose(two, parse_ref("hf.co/o/r:Q4_K_M"))


def test_default_quant_is_ollamas():
    assert DEFAULT_QUANT == "Q4_K_M"
