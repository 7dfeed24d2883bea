"""Integrations with other libraries, each imported on its own: `import adaattn.integrations.hf`.

Nothing here is imported by `import adaattn`, so adaattn never pulls in a third-party library
it does not need.
"""
