"""python -m frontend --port 50051 --scheduler 127.0.0.1:50052"""
from __future__ import annotations

import argparse

from pagedserve.service import Service, add_service_arguments, channel, configure_logging
from pagedserve.v1 import generate_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m frontend", description=__doc__)
    add_service_arguments(parser, default_port=50051)
    parser.add_argument("--scheduler", required=True, help="scheduler address")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the model directory the scheduler reports)")
    parser.add_argument("--max-streams", type=int, default=512, help="concurrent Generate streams")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    from transformers import AutoTokenizer

    from frontend.server import GenerationServicer, SchedulerLink

    scheduler_channel = channel(args.scheduler)
    scheduler = scheduler_pb2_grpc.SchedulerStub(scheduler_channel)
    info = scheduler.GetInfo(scheduler_pb2.SchedulerInfoRequest(), wait_for_ready=True, timeout=args.startup_timeout)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or info.model_dir)
    link = SchedulerLink(scheduler)
    service = Service("frontend", args.host, args.port, max_workers=args.max_streams)
    generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(link, tokenizer, info), service.server)
    service.serve_until_signalled(on_stop=link.close)
    scheduler_channel.close()


if __name__ == "__main__":
    main()
