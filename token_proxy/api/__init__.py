"""The data plane's OpenAI/vLLM dialect: one subpackage per endpoint (chat, completions, generate,
tokenize: request, endpoint, format) over the shared field readers (fields.py), the sampling fields
(sampling.py, parsed into the shared vocabulary's `SamplingRequest`: token_proxy/vocabulary.py), messages
(messages.py) and logprobs (logprobs.py). Handlers hand a parsed request to the pipeline
(pipeline/run.py); none imports another endpoint or lora/."""

from token_proxy.api.fields import token_id_list
from token_proxy.api.logprobs import TokenNamer
from token_proxy.api.messages import parse_chat_prompt
from token_proxy.api.sampling import parse_sampling

__all__ = [
    "TokenNamer", "parse_chat_prompt", "parse_sampling", "token_id_list",
]
