"""Every versioned string a contract file carries: the four schema ids and the packing policies.

Writers put these strings into the JSON files and readers (the trainer's gate, the verifier, the
seed trainer) compare them verbatim, so a change here is a format change: bump the version
suffix, never edit a string in place.
"""

from __future__ import annotations

SPECIAL_TOKENS_SCHEMA = "nedolm_sft_special_tokens_v1"
SHARD_MANIFEST_SCHEMA = "nedolm_sft_shard_manifest_v1"
PACKING_AUDIT_SCHEMA = "nedolm_sft_adaptive_packing_audit_v2"
VERIFY_SCHEMA = "nedolm_sft_final_binary_verify_v1"

PACKING_POLICY = "adaptive_document_turn_overlap_v2"
TARGET_POLICY = "exact_once_non_tool_assistant_targets"
CONTINUATION_POLICY = "prefer_latest_user_or_system_boundary_else_assistant_message_boundary"
