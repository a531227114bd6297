"""Placeholder expansion through the tokenizer, for families whose processor replaces a placeholder by text.

transformers' processor of such a family (Gemma 3: `"\\n\\n<start_of_image>" + soft tokens + "<end_of_image>\\n\\n"`,
pan-and-scan's "Here is the original image ..."; Gemma 4: a video's "mm:ss" frame timestamps) replaces each
placeholder in the prompt's *text* and tokenizes the result. The text at an item's edges then merges with the
prompt's text beside it (SentencePiece-style tokenizers merge across newlines and words: "model\\n" + "\\n\\n" is
not tokens("model\\n") + tokens("\\n\\n")), so splicing the item's tokens into the prompt's tokens would give
other ids than transformers'. A tokenizer splits text at its added (special) tokens first, so only the text
between the placeholder and the special tokens around it can change: `expand_by_text` decodes those two stretches,
puts the item's text between them and tokenizes that again, exactly as the processor's tokenization of the whole
text would. A stretch that is not the tokenizer's own encoding of its text (a client's own ids) is kept as it is,
the item's text tokenized on its own between, as a token-level processor would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from mmserve.multimodal.items import ExpandedPrompt, Modality, MultimodalItem


def expand_by_text(
    tokenizer,
    token_ids: list[int],
    items: list[MultimodalItem],
    placeholders: Mapping[Modality, int],
    render: Callable[[MultimodalItem], str],
    runs: Callable[[MultimodalItem], Sequence[int]],
    soft_tokens: Mapping[Modality, int],
) -> ExpandedPrompt:
    """Expand the k-th placeholder of each modality into the k-th item of that modality: `render(item)` is its
    text (soft tokens written out as the tokenizer's special-token strings), `runs(item)` the lengths of its runs
    of `soft_tokens[modality]` in that text, in order, which its embedding rows fill. Sets each item's offset and
    span (from its first soft token to its last). Raises ValueError when placeholders and items do not match or
    the text does not tokenize into the runs."""
    ordered = _in_prompt_order(token_ids, items, placeholders)
    splits = set(tokenizer.added_tokens_decoder)  # the ids its tokenization splits text at
    marks = set(placeholders.values())
    ids, i = list(token_ids), 0
    for item in ordered:
        p = next(j for j in range(i, len(ids)) if ids[j] in marks)
        a, b = p, p + 1
        while a > 0 and ids[a - 1] not in splits:
            a -= 1
        while b < len(ids) and ids[b] not in splits:
            b += 1
        before, after = ids[a:p], ids[p + 1 : b]
        if _canonical(tokenizer, before) and _canonical(tokenizer, after):
            new = _encode(tokenizer, _decode(tokenizer, before) + render(item) + _decode(tokenizer, after))
        else:
            new = before + _encode(tokenizer, render(item)) + after
        ids[a:b] = new
        i = a + len(new)  # past the item's text and the stretch after it: no placeholder there
    return _place(ids, ordered, runs, soft_tokens)


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) if ids else ""


def _canonical(tokenizer, ids: list[int]) -> bool:
    return not ids or _encode(tokenizer, _decode(tokenizer, ids)) == ids


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _in_prompt_order(token_ids, items, placeholders) -> list[MultimodalItem]:
    """The items in the order of their placeholders (the k-th placeholder of a modality is its k-th item)."""
    for it in items:
        if it.modality not in placeholders:
            raise ValueError(f"this model takes no {it.modality.value} input")
    by_modality = {m: [it for it in items if it.modality == m] for m in placeholders}
    token_to_modality = {tid: m for m, tid in placeholders.items()}
    counts = dict.fromkeys(placeholders, 0)
    ordered = []
    for tid in token_ids:
        modality = token_to_modality.get(tid)
        if modality is None:
            continue
        if counts[modality] < len(by_modality[modality]):
            ordered.append(by_modality[modality][counts[modality]])
        counts[modality] += 1
    for modality, expected in by_modality.items():
        if counts[modality] != len(expected):
            raise ValueError(
                f"prompt has {counts[modality]} {modality.value} placeholder(s) but "
                f"{len(expected)} {modality.value} item(s) were given"
            )
    return ordered


def _place(ids: list[int], ordered, runs, soft_tokens) -> ExpandedPrompt:
    """Each item's runs of soft tokens, in order, become its pad values in the engine's ids."""
    engine_ids = list(ids)
    i = 0
    for item in ordered:
        soft = soft_tokens[item.modality]
        first = last = None
        for length in runs(item):
            while i < len(ids) and ids[i] != soft:
                i += 1
            end = i
            while end < len(ids) and ids[end] == soft:
                end += 1
            if end - i != length:
                raise ValueError(
                    f"{item.modality.value} expansion tokenized into a run of {end - i} soft tokens, {length} expected"
                )
            engine_ids[i:end] = [item.pad_value] * length
            first = i if first is None else first
            last, i = end, end
        item.offset, item.span = first, last - first
    return ExpandedPrompt(engine_ids, ids, list(ordered))
