"""Which object writes a snapshot's tokenizer and processor files (``models/processor.py``)."""
from __future__ import annotations

from types import SimpleNamespace

from paddle_fullparam_callbacks.models.processor import missing_processor, with_processor


class Saves:
    def __init__(self, log, name, **attrs):
        self.log, self.name = log, name
        self.__dict__.update(attrs)

    def save_pretrained(self, directory):
        self.log.append((self.name, directory))


class Qwen2VLImageProcessor(Saves):
    pass


def test_a_processor_that_holds_the_tokenizer_writes_both():
    log = []
    tok = Saves(log, "tok")
    proc = Saves(log, "proc", tokenizer=tok, image_processor=object())
    assert with_processor(tok, proc) is proc
    assert with_processor(None, proc) is proc


def test_an_image_processor_alone_is_written_beside_the_tokenizer():
    log = []
    tok, ip = Saves(log, "tok"), Qwen2VLImageProcessor(log, "ip")
    both = with_processor(tok, ip)
    both.save_pretrained("D")
    assert log == [("tok", "D"), ("ip", "D")]
    vl = SimpleNamespace(config=SimpleNamespace(vision_config=object()))
    assert not missing_processor(vl, both)


def test_no_processor_leaves_the_tokenizer_and_is_noticed_for_a_multimodal_model():
    tok = Saves([], "tok")
    assert with_processor(tok, None) is tok and with_processor(tok, tok) is tok
    vl = SimpleNamespace(config=SimpleNamespace(vision_config=object()))
    text = SimpleNamespace(config=SimpleNamespace())
    assert missing_processor(vl, tok) and not missing_processor(text, tok)
    assert not missing_processor(vl, Saves([], "proc", image_processor=object()))
