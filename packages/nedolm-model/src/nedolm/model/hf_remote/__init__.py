"""Loader code shipped inside every morph export, for ``transformers`` with trust_remote_code.

``configuration_nedolm.py`` and ``modeling_nedolm.py`` are copied verbatim next to the weights
by ``nedolm.model.hf.export_hf``; transformers imports them from its own module cache, so they
import only torch and transformers (never nedolm) and this package never imports them.
"""

REMOTE_CODE_FILES = ("configuration_nedolm.py", "modeling_nedolm.py")
