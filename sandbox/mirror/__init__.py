"""A local stand-in for the Hugging Face Hub: a generated tiny Qwen2 model and a server for it.

``model.generate`` writes the repository; ``server.MirrorServer`` serves it in the Hub's URL
layout with Range support, a token check and a fault switch; ``python3 -m sandbox.mirror`` is
the command line. See README.md.
"""
