#!/usr/bin/env python3
"""Drive a Tessera HTTP front with the official `openai` Python client.

Runs completions and chat, plain and streamed (greedy), with vLLM's
`return_token_ids` extension, and checks that outputs are non-empty, that
streamed and non-streamed runs agree on text and token ids, that usage adds
up, and that bad requests raise the client's typed errors. With `--image F`, a
chat request also carries that image as a data URL (plain and streamed agree,
a broken image is a BadRequestError). Exits non-zero on any failure.

    python tests/openai_client/check_openai.py --base-url http://127.0.0.1:8000/v1
"""

import argparse
import base64
import mimetypes
import sys
import traceback

import openai
from openai import OpenAI

PROMPT = "The old lighthouse"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me about the lighthouse keeper."},
]
EXTRA = {"return_token_ids": True}


def extra(obj, name):
    """A field the OpenAI schema does not know (vLLM extensions)."""
    value = getattr(obj, name, None)
    if value is None and obj.model_extra:
        value = obj.model_extra.get(name)
    return value


def check_usage(usage, completion_tokens):
    assert usage is not None, "no usage"
    assert usage.prompt_tokens > 0, usage
    assert usage.completion_tokens == completion_tokens, (usage, completion_tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage
    details = usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None, usage
    assert 0 <= details.cached_tokens <= usage.prompt_tokens, usage


def completion_plain(client, model, max_tokens):
    r = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body=EXTRA
    )
    assert r.object == "text_completion", r
    choice = r.choices[0]
    ids = extra(choice, "token_ids")
    assert ids, f"no token_ids: {choice}"
    assert choice.text, f"empty text: {choice}"
    assert choice.finish_reason in ("stop", "length"), choice
    assert len(ids) <= max_tokens
    check_usage(r.usage, len(ids))
    return choice.text, ids


def completion_stream(client, model, max_tokens):
    text, ids, finish, usage = "", [], None, None
    for chunk in client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXTRA,
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text or ""
            ids += extra(choice, "token_ids") or []
            finish = choice.finish_reason or finish
    assert finish in ("stop", "length"), finish
    check_usage(usage, len(ids))
    return text, ids


def chat_plain(client, model, max_tokens):
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=max_tokens, temperature=0, extra_body=EXTRA
    )
    assert r.object == "chat.completion", r
    choice = r.choices[0]
    assert choice.message.role == "assistant", choice
    ids = extra(choice, "token_ids")
    assert ids, f"no token_ids: {choice}"
    assert choice.message.content, f"empty content: {choice}"
    assert choice.finish_reason in ("stop", "length"), choice
    check_usage(r.usage, len(ids))
    return choice.message.content, ids


def chat_stream(client, model, max_tokens):
    text, ids, finish, usage, roles = "", [], None, None, []
    for chunk in client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXTRA,
    ):
        assert chunk.object == "chat.completion.chunk", chunk
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            text += choice.delta.content or ""
            ids += extra(choice, "token_ids") or []
            finish = choice.finish_reason or finish
    assert roles[:1] == ["assistant"], roles
    assert finish in ("stop", "length"), finish
    check_usage(usage, len(ids))
    return text, ids


def chat_image(client, model, max_tokens, path):
    """An image as a data URL, plain and streamed: both complete and agree."""
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode()
    mime = mimetypes.guess_type(path)[0] or "image/png"
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this image?"},
                {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}},
            ],
        }
    ]
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=EXTRA
    )
    ids = extra(r.choices[0], "token_ids")
    assert ids and r.choices[0].message.content, r
    check_usage(r.usage, len(ids))
    streamed = []
    for chunk in client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body=EXTRA,
    ):
        for choice in chunk.choices:
            streamed += extra(choice, "token_ids") or []
    assert streamed == ids, f"token ids differ: {streamed} vs {ids}"
    bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": bad}])
    except openai.BadRequestError as e:
        assert e.body and e.body.get("message"), e.body
    else:
        raise AssertionError("a broken image was accepted")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="EMPTY")
    ap.add_argument("--model", help="default: the first model /v1/models lists")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument(
        "--multimodal", action="store_true", help="the model takes images: skip the rejection check"
    )
    ap.add_argument("--image", help="an image file to send as a data URL in a chat request")
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120)
    results = []

    def check(name, fn):
        try:
            fn()
            results.append((name, None))
            print(f"ok    {name}")
        except Exception as e:  # noqa: BLE001 - report every failure, keep going
            results.append((name, e))
            print(f"FAIL  {name}: {e!r}")
            traceback.print_exc()

    models = client.models.list().data
    model = args.model or models[0].id
    print(f"model {model} at {args.base_url}")

    def model_listed():
        assert model in [m.id for m in models], [m.id for m in models]

    check("models list the served model", model_listed)

    def completions():
        plain = completion_plain(client, model, args.max_tokens)
        streamed = completion_stream(client, model, args.max_tokens)
        assert streamed[1] == plain[1], f"token ids differ: {streamed[1]} vs {plain[1]}"
        assert streamed[0] == plain[0], f"text differs: {streamed[0]!r} vs {plain[0]!r}"

    def chat():
        plain = chat_plain(client, model, args.max_tokens)
        streamed = chat_stream(client, model, args.max_tokens)
        assert streamed[1] == plain[1], f"token ids differ: {streamed[1]} vs {plain[1]}"
        assert streamed[0] == plain[0], f"text differs: {streamed[0]!r} vs {plain[0]!r}"

    def token_prompt_and_stop():
        _, ids = completion_plain(client, model, args.max_tokens)
        r = client.completions.create(
            model=model, prompt=ids[:8], max_tokens=4, temperature=0, extra_body=EXTRA
        )
        assert extra(r.choices[0], "prompt_token_ids") in (None, ids[:8]), r
        assert r.usage.prompt_tokens == len(ids[:8]), r.usage
        text, _ = completion_plain(client, model, args.max_tokens)
        stop = text.strip()[:3] or text[:1]
        r = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=args.max_tokens, temperature=0, stop=[stop]
        )
        assert stop not in r.choices[0].text, (stop, r.choices[0].text)
        assert r.choices[0].finish_reason == "stop", r

    def errors():
        for kwargs, exc in [
            ({"model": model, "prompt": PROMPT, "n": 17}, openai.BadRequestError),
            ({"model": model, "prompt": PROMPT, "logprobs": 21}, openai.BadRequestError),
            ({"model": model, "prompt": PROMPT, "temperature": 5}, openai.BadRequestError),
            ({"model": model, "prompt": PROMPT, "max_tokens": -1}, openai.BadRequestError),
            ({"model": model + "-nope", "prompt": PROMPT}, openai.NotFoundError),
        ]:
            try:
                client.completions.create(**kwargs)
            except exc as e:
                assert e.body and e.body.get("message"), e.body
            else:
                raise AssertionError(f"{kwargs} did not raise {exc.__name__}")
        if args.multimodal:
            return
        image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
        try:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": image}]
            )
        except openai.BadRequestError:
            pass
        else:
            raise AssertionError("an image part was accepted by a text-only model")

    def choices_and_logprobs():
        # Two seeded choices; greedy log-probabilities as the client parses them.
        r = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3, n=2
        )
        assert [c.index for c in r.choices] == [0, 1], r
        assert 2 <= r.usage.completion_tokens <= 12, r.usage
        r = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
        )
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs), lp
        assert all(x <= 0 for x in lp.token_logprobs), lp
        assert all(len(t) >= 1 for t in lp.top_logprobs), lp
        r = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
            top_logprobs=2,
        )
        content = r.choices[0].logprobs.content
        assert content and all(len(c.top_logprobs) == 2 for c in content), content
        # Greedy: each token is its step's likeliest.
        assert all(abs(c.logprob - c.top_logprobs[0].logprob) < 1e-6 for c in content), content

    check("completions: plain == streamed (greedy)", completions)
    check("chat: plain == streamed (greedy)", chat)
    check("completions: token-id prompt, stop string", token_prompt_and_stop)
    check("errors map to the client's exceptions", errors)
    check("n choices and log-probabilities", choices_and_logprobs)
    if args.image:
        check("chat with an image", lambda: chat_image(client, model, args.max_tokens, args.image))

    failed = sum(1 for _, e in results if e is not None)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
