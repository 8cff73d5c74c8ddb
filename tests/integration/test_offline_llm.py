"""The offline LLM end to end: the default model against transformers, and the engine's guarantees."""
from __future__ import annotations

import json
import random
import threading

import jsonschema
import pytest
import torch

from pagedserve import LLM, BeamSearchParams, SamplingParams
from scheduler_svc.request import Request
from tests.support.beam_reference import beam_score, reference_beam_search

CHAT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works to a ten year old.",
    "Describe the water cycle in detail.",
    "Give me five tips for learning to cook.",
]


@pytest.fixture(scope="module")
def smollm2():
    return LLM("default", device="cpu", dtype="float32", kv_cache_memory=128 << 20)


def test_default_model_greedy_matches_transformers_token_for_token(smollm2):
    from transformers import AutoModelForCausalLM

    results = smollm2.chat(
        [[{"role": "user", "content": p}] for p in CHAT_PROMPTS], SamplingParams(temperature=0, max_tokens=48)
    )
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2.runner.model_dir, dtype=torch.float32).eval()
    eos = hf_model.generation_config.eos_token_id
    for result in results:
        assert len(result.token_ids) >= 32, result.text
        # transformers' greedy choice at each position given the tokens before it (one teacher-forced pass).
        with torch.no_grad():
            logits = hf_model(torch.tensor([result.prompt_token_ids + result.token_ids[:-1]])).logits[0]
        expected = logits[len(result.prompt_token_ids) - 1:].argmax(-1).tolist()
        assert result.token_ids == expected
        assert len(result.token_ids) == 48 or result.token_ids[-1] in (eos if isinstance(eos, list) else [eos])
        assert result.text == smollm2.tokenizer.decode(expected, skip_special_tokens=True)


def test_chat_answers_sensibly(smollm2):
    [result] = smollm2.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=24)
    )
    assert "Paris" in result.text
    assert result.finish_reason == "stop"


def test_chat_carries_on_a_begun_answer_with_continue_final_message(smollm2):
    begun = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital of France is"}]
    params = SamplingParams(temperature=0, max_tokens=4)
    [result] = smollm2.chat(begun, params, add_generation_prompt=False, continue_final_message=True)
    prompt = smollm2.tokenizer.apply_chat_template(begun, add_generation_prompt=False, continue_final_message=True,
                                                   tokenize=False)
    assert prompt.endswith("The capital of France is")
    assert result.token_ids == smollm2.generate(prompt, params)[0].token_ids
    assert "Paris" in result.text
    with pytest.raises(ValueError, match="continue_final_message"):
        smollm2.chat(begun, params, continue_final_message=True)  # add_generation_prompt left true


def test_chat_shows_the_tools_to_a_template_that_renders_them(smollm2, monkeypatch):
    monkeypatch.setattr(smollm2.tokenizer, "chat_template",
                        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    params = SamplingParams(temperature=0, max_tokens=1)
    [result] = smollm2.chat([{"role": "user", "content": "Weather?"}], params, tools=tools)
    assert smollm2.tokenizer.decode(result.prompt_token_ids) == "[get_weather]Weather?"


def test_a_chat_template_given_as_a_file_replaces_the_tokenizers(tmp_path):
    """--chat-template (ModelConfig.chat_template), for a model whose tokenizer has no template or the wrong one:
    a file or the template itself."""
    from tests.support.tiny_stack import write_tiny_model_with_tokenizer

    model = write_tiny_model_with_tokenizer(tmp_path / "model", vocab_size=49152)  # the tokenizer's ids
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    for given in (str(template), template.read_text()):
        llm = LLM(str(model), device="cpu", dtype="float32", kv_cache_memory=1 << 20, chat_template=given)
        [result] = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=1))
        assert llm.tokenizer.decode(result.prompt_token_ids) == "<user>Hi<assistant>"


def test_a_bos_adding_tokenizer_puts_its_bos_on_text_prompts_once_and_not_on_top_of_a_chat_template(tmp_path):
    """A base model expects its BOS before a text prompt, as transformers' and vLLM's tokenization put it; a chat
    template writes its own, which must not be doubled."""
    from transformers import AutoTokenizer

    from executor_svc.model_loader import resolve_model_dir
    from tests.conftest import write_tiny_model

    write_tiny_model("llama", tmp_path, vocab_size=49152)  # the tokenizer's ids
    AutoTokenizer.from_pretrained(resolve_model_dir("default"), add_bos_token=True).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_memory=1 << 20)
    tokenizer, params = llm.tokenizer, SamplingParams(temperature=0, max_tokens=1)
    [text] = llm.generate("Hello world", params)
    assert text.prompt_token_ids == [tokenizer.bos_token_id] + tokenizer.encode("Hello world", add_special_tokens=False)
    [chat] = llm.chat([{"role": "user", "content": "Hi"}], params)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                             tokenize=False)
    assert rendered.startswith(tokenizer.bos_token)
    assert chat.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)


def test_results_come_back_in_input_order_for_text_and_token_prompts(smollm2):
    token_prompt = smollm2.tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=5)
    batch = smollm2.generate(["Once upon a time", token_prompt, "1, 2, 3,"], params)
    alone = [smollm2.generate(p, params)[0] for p in ["Once upon a time", token_prompt, "1, 2, 3,"]]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    assert batch[1].prompt_token_ids == token_prompt


def test_a_text_prompt_beyond_the_models_vocabulary_is_refused(tiny_model_with_tokenizer):
    # The tiny model embeds 160 ids; its tokenizer (the default model's) spells "Hello" with a larger one.
    llm = LLM(str(tiny_model_with_tokenizer), device="cpu", dtype="float32", kv_cache_memory=1 << 20,
              chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="beyond the model's vocabulary"):
        llm.generate("Hello", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="beyond the model's vocabulary"):
        llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=1))


def test_bad_prompts_raise_value_errors_naming_the_problem(smollm2):
    with pytest.raises(ValueError, match="empty"):
        smollm2.generate("", SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        smollm2.generate([[1, 2, 10**9]], SamplingParams())
    with pytest.raises(ValueError, match="sampling_params"):
        smollm2.generate(["a", "b"], [SamplingParams()])
    for beyond in (dict(logit_bias={10**9: 5.0}), dict(stop_token_ids=[60000])):  # the vocabulary is 49152
        with pytest.raises(ValueError, match=f"^{next(iter(beyond))}.*vocabulary size"):
            smollm2.generate("a", SamplingParams(**beyond))
    with pytest.raises(ValueError, match="context length"):
        smollm2.generate([[5] * smollm2.max_model_len], SamplingParams())


def test_logprobs_are_the_models_own(smollm2):
    [result] = smollm2.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=3))
    assert len(result.logprobs) == 4
    full = torch.tensor([result.prompt_token_ids + result.token_ids])
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(smollm2.runner.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf_model(full).logits[0].float().log_softmax(-1)
    start = len(result.prompt_token_ids) - 1
    for i, (token_id, entry) in enumerate(zip(result.token_ids, result.logprobs)):
        row = logits[start + i]
        assert entry.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
        assert entry.top_token_ids[0] == token_id  # greedy picks the top token
        assert entry.top_logprobs == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


@pytest.fixture(scope="module")
def smollm2_chunked(smollm2):
    """The default model with a pool of 12 blocks, computing prompts 16 tokens a step: preemptions and chunked
    prefills."""
    return LLM("default", device="cpu", dtype="float32", kv_cache_memory=12 * smollm2.runner.block_bytes,
               long_prefill_token_threshold=16)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2.runner.model_dir, dtype=torch.float32).eval()


def test_beam_search_finds_the_beams_the_reference_finds(smollm2, hf_smollm2):
    prompts = ["The capital of France is", [1, 504, 3575, 282]]
    outputs = smollm2.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5))
    eos = smollm2.tokenizer.eos_token_id
    for prompt, output in zip(prompts, outputs):
        ids = smollm2.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        expected = reference_beam_search(hf_smollm2, eos, ids, 3, 6, 0.5)
        generated = [s.tokens[len(ids):] for s in output.sequences]
        assert all(s.tokens[:len(ids)] == ids for s in output.sequences)
        # Scores, not tokens: a near tie may order two beams apart in another float32 implementation.
        assert [beam_score(hf_smollm2, eos, ids, g, 0.5) for g in generated] == \
            pytest.approx([score for _, score in expected], abs=1e-4)
        for sequence, tokens in zip(output.sequences, generated):
            assert sequence.finish_reason == ("stop" if tokens[-1] == eos else "length")
            assert sequence.text == smollm2.tokenizer.decode(tokens[:-1] if tokens[-1] == eos else tokens)
            assert sequence.cum_logprob == pytest.approx(beam_score(hf_smollm2, eos, ids, tokens, 0.0), abs=1e-3)
    with pytest.raises(ValueError, match="^beam_width must be in"):
        BeamSearchParams(beam_width=11, max_tokens=4)


def test_prompt_logprobs_equal_transformers_log_softmax_across_prefill_chunks(smollm2, smollm2_chunked, hf_smollm2):
    prompt = "The quick brown fox jumps over the lazy dog, and then it runs far away into the green forest."
    [result] = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    ids = result.prompt_token_ids
    with torch.no_grad():
        expected = hf_smollm2(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert len(ids) > 16 and len(result.prompt_logprobs) == len(ids) and result.prompt_logprobs[0] is None
    for position, entry in enumerate(result.prompt_logprobs[1:], start=1):
        row = expected[position - 1]  # the logits after position - 1 predict the token at position
        assert entry.token_id == ids[position]
        assert entry.logprob == pytest.approx(row[ids[position]].item(), abs=1e-4)
        assert entry.top_logprobs == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
    # In chunks of 16 prompt tokens, each chunk's first token is scored by the row the previous one ended on.
    [chunked] = smollm2_chunked.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    assert [e.token_id for e in chunked.prompt_logprobs[1:]] == ids[1:]
    assert [e.logprob for e in chunked.prompt_logprobs[1:]] == pytest.approx(
        [e.logprob for e in result.prompt_logprobs[1:]], abs=1e-4)


def test_n_choices_share_the_prompts_prefill_and_are_reproducible_with_a_seed(smollm2):
    prompt = "Write one sentence about the sea. " * 4
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=10, ignore_eos=True)
    hits_before = smollm2.block_manager.prefix_hits
    results = smollm2.generate([prompt, "Name a color:"], params, cache_salt="n-choices")
    assert [(r.prompt_token_ids == results[0].prompt_token_ids, r.index) for r in results[:3]] == \
        [(True, 0), (True, 1), (True, 2)]
    assert [r.index for r in results[3:]] == [0, 1, 2]
    assert all(len(r.token_ids) == 10 for r in results)
    assert len({r.text for r in results[:3]}) == 3, "seeded choices are seeded apart"
    # The two siblings found every full block of the first choice's prompt cached (its salt is new).
    shared = (len(results[0].prompt_token_ids) - 1) // 16 * 16
    assert smollm2.block_manager.prefix_hits - hits_before >= 2 * shared > 0
    again = smollm2.generate([prompt, "Name a color:"], params, cache_salt="n-choices")
    assert [r.token_ids for r in again] == [r.token_ids for r in results]
    # Choice i of n is the request that choice would be alone: n=1 with the seed i after it.
    [third] = smollm2.generate(prompt, SamplingParams(seed=13, temperature=1.0, max_tokens=10, ignore_eos=True))
    assert third.token_ids == results[2].token_ids


PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _json_chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False), add_special_tokens=False)


def test_preempted_structured_and_penalised_requests_recompute_to_the_same_output(smollm2, smollm2_chunked,
                                                                                  monkeypatch):
    small = smollm2_chunked
    # Last in, first preempted.
    prompts = [_json_chat(smollm2, "List some fruits, again and again."),
               _json_chat(smollm2, "Describe a person as JSON with a name and an age.")]
    params = [SamplingParams(temperature=0, max_tokens=48, repetition_penalty=1.3, frequency_penalty=0.5,
                             presence_penalty=0.3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=48, json_schema=json.dumps(PERSON_SCHEMA))]
    fillers = [f"Count from {i} to {i + 40}:" for i in range(4)]
    filler_params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    all_prompts, all_params = fillers + prompts, [filler_params] * 4 + params
    reference = smollm2.generate(all_prompts, all_params)

    preempted = []
    preempt = small.scheduler._preempt
    monkeypatch.setattr(small.scheduler, "_preempt", lambda request: (preempted.append(request.request_id),
                                                                       preempt(request)))
    constrained = small.generate(all_prompts, all_params)
    penalised, structured = constrained[4:]
    assert small.scheduler.num_preemptions > 0
    assert {structured.request_id, penalised.request_id} <= set(preempted), "both must have been recomputed"
    assert [r.token_ids for r in constrained] == [r.token_ids for r in reference]
    jsonschema.validate(json.loads(structured.text), PERSON_SCHEMA)
    assert structured.finish_reason == "stop"


@pytest.mark.parametrize("cache_salt", [None, "nothing-cached"])
def test_grammar_and_penalties_are_rebuilt_from_a_prefix_that_holds_outputs(smollm2, monkeypatch, cache_salt):
    """A request re-admitted with outputs (after a preemption, or a scheduler restart): from its cached prefix
    (prefix_token_ids carry the outputs to the executor), or computing them all, it goes on as it would have."""
    prompt = _json_chat(smollm2, "Describe a person as JSON with a name and an age.")
    params = SamplingParams(temperature=0, max_tokens=40, json_schema=json.dumps(PERSON_SCHEMA),
                            repetition_penalty=1.2, frequency_penalty=0.4)
    [whole] = smollm2.generate([prompt], params)  # its blocks, outputs included, are now cached (unsalted)
    half = len(whole.token_ids) // 2
    admissions = []
    new_state = smollm2.runner._new_state
    monkeypatch.setattr(smollm2.runner, "_new_state", lambda req: (admissions.append(req), new_state(req))[1])
    request = Request("resumed", prompt, params, smollm2.eos_token_ids, smollm2.max_model_len, cache_salt,
                      output_token_ids=whole.token_ids[:half])
    smollm2.scheduler.add_request(request)
    while smollm2.scheduler.has_unfinished_requests():
        smollm2.scheduler.step(smollm2.runner.execute)
    assert request.output_token_ids == whole.token_ids
    jsonschema.validate(json.loads(smollm2.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)),
                        PERSON_SCHEMA)
    [admitted] = admissions
    if cache_salt is None:
        assert len(admitted.prefix_token_ids) > len(prompt), "the cached prefix reaches into the outputs"
    else:
        assert admitted.prefix_token_ids == [] and admitted.start_position == 0


def test_a_compiling_grammar_holds_up_no_other_request(smollm2, monkeypatch):
    """The executor compiles a grammar on a thread of its own; until it is ready, its request is not sampled
    (its last token is computed again, and counted once) while the others go on. Its output is what it would
    have been."""
    prompt = _json_chat(smollm2, "Describe a person as JSON with a name and an age.")

    def params(title: str) -> SamplingParams:  # the title changes the schema's text, not its grammar
        return SamplingParams(temperature=0, max_tokens=40, json_schema=json.dumps({**PERSON_SCHEMA, "title": title}),
                              repetition_penalty=1.2, frequency_penalty=0.5)

    [whole] = smollm2.generate([prompt], params("compiled at once"))  # alone in its steps: never deferred
    release = threading.Event()
    structured_output = smollm2.runner.structured_output
    compile_grammar = structured_output._compile
    monkeypatch.setattr(structured_output, "_compile", lambda *source: (release.wait(120), compile_grammar(*source))[1])
    scheduler = smollm2.scheduler
    recomputed = scheduler.num_recomputed_tokens
    plain_params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    scheduler.add_request(Request("plain", smollm2.tokenizer.encode("Once upon a time"), plain_params,
                                  smollm2.eos_token_ids, smollm2.max_model_len))
    # Resumed (as after a preemption) after an output token that comes again: computed again at each deferral,
    # it must still be counted once, or its frequency penalty would change what follows.
    tokens = whole.token_ids
    half = next(k for k in range(1, len(tokens)) if tokens[k - 1] in tokens[k:])
    structured = Request("structured", prompt, params("compiled while others run"), smollm2.eos_token_ids,
                         smollm2.max_model_len, output_token_ids=whole.token_ids[:half])
    scheduler.add_request(structured)
    plain_tokens = []
    while len(plain_tokens) < 6:
        for output in scheduler.step(smollm2.runner.execute):
            assert output.request_id == "plain", "the structured request cannot be sampled before its grammar"
            plain_tokens += output.new_token_ids
    assert scheduler.num_recomputed_tokens - recomputed >= 5, "deferred at every step the other one ran"
    release.set()  # alone in the step now, the structured request waits for its grammar
    while scheduler.has_unfinished_requests():
        scheduler.step(smollm2.runner.execute)
    assert structured.output_token_ids == whole.token_ids
    jsonschema.validate(json.loads(whole.text), PERSON_SCHEMA)
    assert plain_tokens == smollm2.generate("Once upon a time", plain_params)[0].token_ids


# ----------------------------------------------------------------------------- tiny random model


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_memory=4 << 20)


def random_token_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 150) for _ in range(rng.randint(5, 40))] for _ in range(count)]


def test_preemption_under_a_quarter_pool_leaves_greedy_outputs_unchanged(tiny_llama_dir, tiny_llm):
    prompts = random_token_prompts(32, seed=0)
    # Logprobs make the comparison sensitive: a tiny random model's greedy tokens barely depend on context.
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    unconstrained = tiny_llm.generate(prompts, params)
    assert tiny_llm.scheduler.num_preemptions == 0

    block_size = 16
    needed_blocks = sum(-(-(len(p) + 24) // block_size) for p in prompts)
    bytes_per_block = tiny_llm.runner.config.kv_bytes_per_token(torch.float32) * block_size
    constrained_llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32",
                          kv_cache_memory=(needed_blocks // 4) * bytes_per_block)
    assert constrained_llm.runner.num_blocks == needed_blocks // 4
    constrained = constrained_llm.generate(prompts, params)
    assert constrained_llm.scheduler.num_preemptions > 0
    assert [r.token_ids for r in constrained] == [r.token_ids for r in unconstrained]
    for a, b in zip(constrained, unconstrained):
        assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-4)
    assert all(r.finish_reason == "length" for r in constrained)


def test_bad_words_hold_through_preemption(tiny_llama_dir, tiny_llm):
    # Each request bans a pair of its own greedy output's tokens: its output never holds that pair, and a request
    # preempted and recomputed (its output's tail rebuilt from its tokens) ends as it would have unpreempted.
    prompts = random_token_prompts(16, seed=3)
    plain = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words_token_ids=[r.token_ids[4:6]])
              for r in plain]
    unpreempted = tiny_llm.generate(prompts, params)
    for result, before, p in zip(unpreempted, plain, params):
        pairs = list(zip(result.token_ids, result.token_ids[1:]))
        assert tuple(p.bad_words_token_ids[0]) not in pairs and result.token_ids != before.token_ids
    bytes_per_block = tiny_llm.runner.block_bytes
    needed = sum(-(-(len(p) + 24) // 16) for p in prompts)
    small = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_memory=(needed // 4) * bytes_per_block,
                preemption_mode="recompute")
    preempted = small.generate(prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert [r.token_ids for r in preempted] == [r.token_ids for r in unpreempted]


@pytest.mark.parametrize("pool", ["ample", "quarter"])
def test_slots_reserved_ahead_leave_greedy_outputs_unchanged(tiny_llama_dir, pool):
    """Three steps out, the engine plans steady decode steps on slots the block manager reserved ahead, without
    calling it: the outputs of one step at a time, with a pool to spare and under preemption."""
    prompts = random_token_prompts(24, seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    block_size = 16
    needed_blocks = sum(-(-(len(p) + 40) // block_size) for p in prompts)
    bytes_per_block = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_memory=4 << 20) \
        .runner.config.kv_bytes_per_token(torch.float32) * block_size
    memory = (needed_blocks * 2 if pool == "ample" else needed_blocks // 4) * bytes_per_block
    one_at_a_time = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_memory=memory,
                        async_scheduling=False)
    ahead = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_memory=memory)
    ahead.engine.steps_ahead = 3
    expected, got = one_at_a_time.generate(prompts, params), ahead.generate(prompts, params)
    assert ahead.scheduler.num_calls_skipped > 0
    if pool == "quarter":
        assert ahead.scheduler.num_preemptions > 0
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    for a, b in zip(got, expected):
        assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-4)
    manager = ahead.block_manager
    assert manager.num_requests == 0 and manager.num_free_blocks == manager.num_blocks


def test_seeded_sampling_is_the_same_alone_and_in_any_batch(tiny_llm):
    prompts = random_token_prompts(6, seed=1)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    [alone] = tiny_llm.generate([prompts[0]], seeded)
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 5
    batched = tiny_llm.generate(prompts[1:4] + [prompts[0]] + prompts[4:], others[:3] + [seeded] + others[3:])
    assert batched[3].token_ids == alone.token_ids
    [again] = tiny_llm.generate([prompts[0]], seeded)
    assert again.token_ids == alone.token_ids


def test_min_tokens_holds_back_stop_tokens(tiny_llm):
    prompt = random_token_prompts(1, seed=2)[0]
    [free] = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    first = free.token_ids[0]
    [stopped] = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first]))
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    # With min_tokens the stop token cannot be sampled for the first 3 tokens, so greedy picks another.
    [held] = tiny_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=3, stop_token_ids=[first])
    )
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3


def test_the_models_generation_config_gives_the_default_sampling_parameters(tmp_path):
    """As vLLM's LLM: generate() without SamplingParams samples with those of the model's generation_config.json
    (here greedy, 5 tokens at most); generation_config="vllm" keeps SamplingParams' own."""
    from tests.conftest import write_tiny_model

    write_tiny_model("llama", tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**saved, "temperature": 0.0, "max_new_tokens": 5}))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_memory=4 << 20)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    prompts = random_token_prompts(3, seed=4)
    assert [r.token_ids for r in llm.generate(prompts)] == [
        r.token_ids for r in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5))]
    neutral = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_memory=4 << 20, generation_config="vllm")
    assert neutral.get_default_sampling_params() == SamplingParams()


def test_prompts_without_a_tokenizer_must_be_token_ids(tiny_llm):
    with pytest.raises(ValueError, match="token ids"):
        tiny_llm.generate("some text", SamplingParams())
    [result] = tiny_llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(result.token_ids) == 3 and result.text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        tiny_llm.generate([[3, 4, 5]], SamplingParams(stop=["x"]))


def test_steps_planned_ahead_give_the_outputs_of_one_step_at_a_time(smollm2):
    """The same batch with and without async scheduling: greedy tokens, texts and finish reasons alike,
    including a structured request, whose grammar accepts its end a step before the engine knows it."""
    sync = LLM("default", device="cpu", dtype="float32", kv_cache_memory=128 << 20, async_scheduling=False)
    assert smollm2.config.scheduler_config.async_scheduling and not sync.config.scheduler_config.async_scheduling
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    conversations = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS[:2]]
    conversations.append([{"role": "user", "content": "Describe a person as JSON with a name and an age."}])
    params = [SamplingParams(temperature=0, max_tokens=40, stop=["\n\n"]), SamplingParams(temperature=0, max_tokens=40),
              SamplingParams(temperature=0, max_tokens=64, json_schema=json.dumps(person))]
    results = [llm.chat(conversations, params) for llm in (smollm2, sync)]
    for ahead, one_by_one in zip(*results):
        assert (ahead.token_ids, ahead.text, ahead.finish_reason) == (
            one_by_one.token_ids, one_by_one.text, one_by_one.finish_reason)
    structured = results[0][2]
    assert structured.finish_reason == "stop" and set(json.loads(structured.text)) == {"name", "age"}
    # Every block came back (the step planned ahead for a finished request included).
    manager = smollm2.block_manager
    assert manager.num_requests == 0 and manager.num_free_blocks == manager.num_blocks
