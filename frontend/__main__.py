"""python -m frontend --port 50051 --scheduler 127.0.0.1:50052 [--http-address 127.0.0.1:8000]"""
from __future__ import annotations

import logging

from pagedserve.chat import load_chat_template
from pagedserve.config import PROMPT_CHARS_PER_TOKEN, ModelConfig, ServingConfig, model_name, parse
from pagedserve.sampling_params import generation_config_defaults
from pagedserve.service import AioService, Security, channel, configure_logging, pin_to_cpus, set_nice
from pagedserve.v1 import generate_pb2, generate_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger("frontend")

SECTIONS = {
    ServingConfig: ("host", "port", "log_level", "cpus", "nice", "scheduler", "startup_timeout", "max_streams",
                    "max_message_bytes", "http_address", "served_model_name", "drain_timeout_s", "max_prompt_chars",
                    "enable_auto_tool_choice", "tool_call_parser", "reasoning_parser", "responses_store_size",
                    "tls_cert", "tls_key", "tls_ca", "tls_client_ca", "api_key_file", "internal_token_file"),
    ModelConfig: ("tokenizer", "chat_template", "generation_config"),
}


def parse_args(argv: list[str] | None = None) -> dict:
    return parse("python -m frontend", __doc__, SECTIONS, argv, required=("scheduler",))


def main(argv: list[str] | None = None) -> None:
    configs = parse_args(argv)
    serving = configs[ServingConfig]
    configure_logging(serving.log_level)
    pin_to_cpus(serving.cpus)
    set_nice(serving.nice)
    from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE
    from grpc_reflection.v1alpha import reflection
    from transformers import AutoTokenizer

    from frontend.metrics import FrontendMetrics
    from frontend.server import GenerationServicer, SchedulerLink, read_backend_stats
    from pagedserve.output.detokenizer import prepare as prepare_detokenizer

    security = Security.from_config(serving)
    scheduler_channel = channel(serving.scheduler, security)
    scheduler = scheduler_pb2_grpc.SchedulerStub(scheduler_channel)
    info = scheduler.GetInfo(scheduler_pb2.SchedulerInfoRequest(), wait_for_ready=True, timeout=serving.startup_timeout)
    tokenizer = AutoTokenizer.from_pretrained(configs[ModelConfig].tokenizer or info.model_dir)
    if configs[ModelConfig].chat_template:
        tokenizer.chat_template = load_chat_template(configs[ModelConfig].chat_template)
    prepare_detokenizer(tokenizer)
    sampling_defaults = generation_config_defaults(configs[ModelConfig].generation_config, info.model_dir)
    if sampling_defaults:
        logger.warning("requests that leave them unset take the model's generation config's sampling parameters %s "
                       "(--generation-config vllm: vLLM's neutral defaults instead)", sampling_defaults)
    link = SchedulerLink(scheduler)
    service = AioService("frontend", serving.host, serving.listen_port("frontend"), security=security, public=True,
                         max_message_bytes=serving.max_message_bytes, dependencies={"scheduler_svc": serving.scheduler})
    max_prompt_chars = serving.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * info.max_model_len
    model_names = serving.served_model_name or (model_name(info.model),)
    # Served on the HTTP API's /metrics; without it, nothing is measured.
    metrics = (FrontendMetrics(model_names[0], info.max_model_len, lambda: read_backend_stats(scheduler))
               if serving.http_address else None)
    servicer = GenerationServicer(link, tokenizer, info, max_prompt_chars, serving.max_streams, metrics,
                                  sampling_defaults)
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, service.server)
    # Tools such as grpcurl list and call the public API by reflection (with an API key where one is required).
    reflection.enable_server_reflection(
        (generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name, HEALTH_SERVICE, reflection.SERVICE_NAME),
        service.server)
    http = None
    if serving.http_address:
        from frontend.http_server import HttpServer, OpenAIServer

        api = OpenAIServer(link, tokenizer, model_names, info.max_model_len, info.vocab_size, max_prompt_chars,
                           security.api_key_ok if security.api_keys else None, metrics,
                           serving.tool_call_parser if serving.enable_auto_tool_choice else None,
                           serving.reasoning_parser, serving.responses_store_size, sampling_defaults)
        http = HttpServer(api.app, serving.http_address, serving.log_level, serving.tls_cert, serving.tls_key,
                          serving.tls_client_ca)
        http.start()

    def stop() -> None:
        if http is not None:
            http.stop()
        link.close()

    service.serve_until_signalled(on_stop=stop, drainable=link, drain_timeout=serving.drain_timeout_s)
    scheduler_channel.close()


if __name__ == "__main__":
    main()
