"""`attnlab serve --guard ppl`: a flagged chat request gets a 400 naming the reason (through the official client);
an ordinary one is answered."""
from __future__ import annotations

import pytest

from attnlab.robust.defenses import CALIBRATED

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def guarded(smollm2):
    from attnlab.robust.defenses import Guard
    from attnlab.serve import ServeConfig, create_app
    from tests.serve.conftest import running
    app = create_app(smollm2, ServeConfig("smollm2-135m", max_tokens=4, guard=Guard.parse("ppl")))
    with running(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_flagged_request_gets_400_naming_the_reason(guarded):
    attacked = "What is the capital of France? ')). !amoto :,}\". ! !HCR '))OCKmerce guarantaled ! microwave.],7;4"
    with pytest.raises(openai.BadRequestError) as e:
        guarded.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": attacked}])
    threshold = CALIBRATED["SmolLM2-135M-Instruct.Q4_1.gguf", "chat"]
    assert "perplexity filter" in str(e.value) and f"{threshold:g}" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="perplexity filter"):
        guarded.completions.create(model="smollm2-135m", prompt=attacked, max_tokens=2)


def test_ordinary_request_is_answered(guarded):
    out = guarded.chat.completions.create(model="smollm2-135m", messages=[{"role": "user",
                                                                         "content": "Tell me about the sea."}])
    assert out.choices[0].message.content
