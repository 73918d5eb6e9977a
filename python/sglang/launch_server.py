"""`python -m sglang.launch_server [--model-path PATH] [flags]`: serve a model over HTTP.

With no `--model-path` (or `--model-path demo`) a tiny built-in demo model with random weights and
two demo LoRA adapters is materialised into $SGLANG_CACHE_DIR and served, so the first run needs no
download.
"""

from __future__ import annotations

import signal
import sys

from sglang.srt.server_args import prepare_server_args
from sglang.srt.utils import configure_logger


def main(argv: list[str] | None = None) -> None:
    try:
        server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    configure_logger(server_args.log_level)
    # Ctrl-C stops start-up as it stops the server once uvicorn serves (uvicorn takes SIGINT
    # whatever the disposition this process inherited: a script's `&` job starts with it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if server_args.model_path == "demo":
        from sglang.srt.tools.demo import print_demo_banner

        # The demo serves its adapters unless LoRA was configured by hand (server_configs.resolve_model).
        print_demo_banner(with_adapters=server_args.demo_serves_its_adapters)
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.entrypoints.worker_node import run_worker_node
    from sglang.srt.managers.scheduler_ranks import StartupError

    try:
        if server_args.node_rank > 0:  # a multi-node TP group: node 0 serves, this node computes
            run_worker_node(server_args)
        else:
            launch_server(server_args)
    except ValueError as e:  # a configuration the user can fix: no traceback needed
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except StartupError as e:  # a scheduler rank failed to start: its own traceback is the story
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C before the HTTP server ran (it handles SIGINT itself after)
        print("Interrupted during start-up; the scheduler was stopped.", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
