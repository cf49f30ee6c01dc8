"""Structured outputs on the embedded SmolLM2: 14 JSON schemas of varied shape, greedy and
sampled, every output parsed and validated with ``jsonschema``; regex, choice and a Lark
grammar checked with ``re`` and ``lark``. One ``generate`` call per configuration, all
requests batched together."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest

from jaxpage import LLM, SamplingParams, StructuredOutputsParams

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {
        "type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": NAME, "address": {"type": "object", "properties": {
            "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]}}, "required": ["name", "address"]}},
        "required": ["user"]},
    "bounded_array": {"type": "object", "properties": {"colors": {
        "type": "array", "items": {"enum": ["red", "green", "blue", "black"]},
        "minItems": 2, "maxItems": 4}}, "required": ["colors"]},
    "enum": {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "calm"]},
                                              "level": {"enum": [1, 2, 3]}},
             "required": ["mood", "level"]},
    "number_range": {"type": "object", "properties": {
        "temperature": {"type": "number", "minimum": -30, "maximum": 45},
        "humidity": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}},
        "required": ["temperature", "humidity"]},
    "optional": {"type": "object", "properties": {"title": NAME,
                                                  "subtitle": NAME, "pages": {
                                                      "type": "integer", "minimum": 1,
                                                      "maximum": 2000}},
                 "required": ["title"]},
    "ref": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "y": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["x", "y"]}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"},
                                         "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"]},
    "any_of": {"type": "object", "properties": {"id": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 999}, {"type": "string", "maxLength": 8}]}},
        "required": ["id"]},
    "one_of": {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"},
                                          "radius": {"type": "integer", "minimum": 1,
                                                     "maximum": 50}},
         "required": ["kind", "radius"]},
        {"type": "object", "properties": {"kind": {"const": "square"},
                                          "side": {"type": "integer", "minimum": 1,
                                                   "maximum": 50}},
         "required": ["kind", "side"]}]}}, "required": ["shape"]},
    "array_of_objects": {"type": "object", "properties": {"items": {
        "type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"]}}}, "required": ["items"]},
    "booleans_and_null": {"type": "object", "properties": {
        "active": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 20}},
        "required": ["active", "note"]},
    "date_format": {"type": "object", "properties": {"event": NAME,
                                                     "date": {"type": "string", "format": "date"}},
                    "required": ["event", "date"]},
    "const_and_tuple": {"type": "object", "properties": {
        "version": {"const": 2}, "pair": {"type": "array", "prefixItems": [
            {"type": "string", "maxLength": 10}, {"type": "integer", "minimum": 0, "maximum": 9}],
            "items": False}}, "required": ["version", "pair"]},
    "top_level_array": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"word": {"type": "string", "maxLength": 12}},
        "required": ["word"]}},
}


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return LLM(smollm2_path, max_model_len=512, max_num_seqs=32, num_kv_blocks=512)


def _chat_prompt(llm, text: str) -> dict:
    ids = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, return_dict=True,
        add_generation_prompt=True)["input_ids"]
    return {"prompt_token_ids": list(ids)}


def _check_schemas(llm, temperature: float) -> None:
    names = list(SCHEMAS)
    prompts = [_chat_prompt(llm, f"Reply with JSON for: {name.replace('_', ' ')}.")
               for name in names]
    params = [SamplingParams(max_tokens=160, temperature=temperature, seed=i,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]))
              for i, name in enumerate(names)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for name, output in zip(names, outputs):
        text = output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name],
                            format_checker=jsonschema.FormatChecker())


def test_json_schemas_greedy(smollm2):
    _check_schemas(smollm2, 0.0)


# ~25 s, slow: grammars under sampling run in the default suite in the regex / choice /
# grammar test below (temperature 0.8) and in the tiny model's random masks
@pytest.mark.slow
def test_json_schemas_sampled(smollm2):
    _check_schemas(smollm2, 0.7)


GRAMMAR = r"""
start: sentence
sentence: WORD (" " WORD)* "."
WORD: /[a-z]{1,10}/
"""


def test_regex_choice_and_grammar(smollm2):
    prompts = [_chat_prompt(smollm2, t) for t in (
        "What is your phone number?", "Is the sky blue?", "Describe a cat in a sentence.")]
    specs = [StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{3}-[0-9]{4}"),
             StructuredOutputsParams(choice=["yes", "no"]),
             StructuredOutputsParams(grammar=GRAMMAR)]
    for temperature in (0.0, 0.8):
        params = [SamplingParams(max_tokens=60, temperature=temperature, seed=1,
                                 structured_outputs=s) for s in specs]
        phone, answer, sentence = [o.outputs[0].text for o in smollm2.generate(
            prompts, params, use_tqdm=False)]
        assert re.fullmatch(r"[0-9]{3}-[0-9]{3}-[0-9]{4}", phone), phone
        assert answer in ("yes", "no"), answer
        lark.Lark(GRAMMAR).parse(sentence)
