"""odma-bench subcommands: each module exposes add_arguments(parser) and run(args) -> dict."""
