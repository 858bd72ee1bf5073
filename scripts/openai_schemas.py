#!/usr/bin/env python3
"""Extract the parts of OpenAI's published OpenAPI document that mlxcluster serves into
``tests/data/openai_schemas.json`` (the schemas the API tests validate answers against).

Usage: scripts/openai_schemas.py OPENAPI_JSON [OUT [COMMIT]]

OPENAPI_JSON: ``openapi.json`` of github.com/openai/openai-openapi (the commit is recorded in
the output).  Descriptions and examples are dropped; ``$ref``s stay (resolved by the test
against ``components.schemas``); OpenAPI 3.0's ``nullable: true`` left in the 3.1 document is
rewritten as ``anyOf [..., {"type": "null"}]`` so a JSON Schema validator reads it as the spec
means it.
"""

import json
import sys

ROOTS = ["CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse",
         "ListModelsResponse", "Model", "ErrorResponse", "Response", "ResponseCreatedEvent",
         "ResponseInProgressEvent", "ResponseOutputItemAddedEvent", "ResponseContentPartAddedEvent",
         "ResponseTextDeltaEvent", "ResponseTextDoneEvent", "ResponseContentPartDoneEvent",
         "ResponseOutputItemDoneEvent", "ResponseCompletedEvent", "ResponseIncompleteEvent"]
DROP = {"description", "example", "examples", "title", "x-oaiMeta", "x-oaiExpandable", "x-stainless-const",
        "deprecated", "x-oaiTypeLabel", "format"}


def clean(node):
    if isinstance(node, list):
        return [clean(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: clean(v) for k, v in node.items() if k not in DROP}
    if out.pop("nullable", False):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


def refs(node, found):
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            found.add(ref.rsplit("/", 1)[1])
        for v in node.values():
            refs(v, found)
    elif isinstance(node, list):
        for v in node:
            refs(v, found)


def main(argv):
    doc = json.load(open(argv[1]))
    schemas = doc["components"]["schemas"]
    want, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name in want:
            continue
        want.add(name)
        found = set()
        refs(schemas[name], found)
        todo.extend(found - want)
    commit = argv[3] if len(argv) > 3 else "unknown"
    out = {"source": f"github.com/openai/openai-openapi openapi.json at {commit}", "info_version": doc["info"]["version"],
           "roots": ROOTS, "schemas": {n: clean(schemas[n]) for n in sorted(want)}}
    path = argv[2] if len(argv) > 2 else "tests/data/openai_schemas.json"
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"), sort_keys=True)
    print(f"{path}: {len(want)} schemas")


if __name__ == "__main__":
    main(sys.argv)
