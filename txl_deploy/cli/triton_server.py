"""`txl-deploy triton-server`: serve a Triton model repository with a local tritonserver, without Docker."""

from __future__ import annotations

import signal

import click

from txl_deploy.serving.triton.local_server import TritonServer


@click.command("triton-server")
@click.argument("repository", type=click.Path(exists=True, file_okay=False))
@click.option("--http-port", type=click.IntRange(1, 65535), default=8000, show_default=True,
              help="HTTP port on 127.0.0.1.")
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=8001, show_default=True,
              help="gRPC port on 127.0.0.1.")
@click.option("--log", "log_path", type=click.Path(dir_okay=False),
              help="The server's log file. [default: a temporary folder]")
def triton_server(repository, http_port, grpc_port, log_path):
    """Serve REPOSITORY (written by `txl-deploy triton-repo --backend python`) in the foreground with the
    tritonserver that the nvidia-pytriton wheel bundles (Triton 2.51, Python backend), on 127.0.0.1. Ctrl-C or
    SIGTERM stops it.

    \b
    The server files go beside your environment, not into it (the wheel pins numpy < 2):
      pip install --no-deps --target .venv/triton nvidia-pytriton==0.7.0
    TXL_TRITONSERVER may name another tritonserver binary (its backends are found beside it).
    """
    server = TritonServer(repository, http_port=http_port, grpc_port=grpc_port, log_path=log_path)
    server.start()
    click.echo(f"tritonserver ready: {server.http_url} (HTTP), {server.grpc_url} (gRPC); log {server.log_path}; "
               "Ctrl-C stops it")
    # SIGTERM (e.g. from a service manager) stops the server as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.__exit__(None, None, None)


COMMANDS = [triton_server]
