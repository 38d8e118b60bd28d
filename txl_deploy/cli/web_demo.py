"""`txl-deploy web-demo`: a static site that runs an exported model in the browser (onnxruntime-web)."""

from __future__ import annotations

import click

from txl_deploy.exporters.web.site import write_site


@click.command("web-demo")
@click.argument("model", metavar="MODEL.onnx", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False),
              help="Folder to write the site into (index.html, app.js, txl.js and the modules it imports, music.js, "
                   "pianoroll.js, model.onnx, model.json, vocab.json).")
@click.option("--ort-web", type=click.Path(exists=True, file_okay=False), metavar="DIR",
              help="Use this local onnxruntime-web (a folder where `npm install onnxruntime-web` ran, or the "
                   "package itself) and copy its runtime into the site, for devices without internet access. "
                   "[default: a pinned release from the jsDelivr CDN, checked by subresource-integrity hashes]")
@click.option("--title", help="Page title. [default: the model's description: its source, vocabulary, layers, "
              "parameters and precision]")
@click.option("--prompt", help="The prompt the page starts with. [default: a short one the vocabulary can spell; "
              "Bar_None for a music model]")
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
def web_demo(model, output, ort_web, title, prompt, force):
    """Write a static web site that runs MODEL.onnx in the browser with onnxruntime-web (WebAssembly, and WebGPU
    where the browser has it): the page streams generated text for a prompt, with temperature and top-k, and
    shows the latency of every token. For a music model (REMI or remi-xl events) it samples under the music
    grammar, draws the notes as a piano roll while they are generated, and plays them (WebAudio, no plug-in).
    Any static HTTP server can serve it. The output says where the page will
    load onnxruntime-web from; a page that cannot load it says so, and what to do.

    \b
    Example:
      txl-deploy web-demo model.onnx -o site/
      python -m http.server -d site 8000     # then open http://localhost:8000/
    """
    write_site(model, output, ort_web=ort_web, force=force, title=title, prompt=prompt)


COMMANDS = [web_demo]
