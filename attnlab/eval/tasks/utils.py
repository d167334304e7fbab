"""Loaders the task YAMLs name with `!function utils.<name>`: the JSONL files beside them."""
from attnlab.eval.lmeval_tasks import load


def nextline(**kw):
    return load("nextline")


def cloze(**kw):
    return load("cloze")


def plays_ppl(**kw):
    return load("plays_ppl")
