"""What turns a step's logits into tokens: sampling, grammar constraints, prompt-lookup drafts, rewinding a draft.

``sampling`` picks a token (mlx-lm's samplers); ``constraint`` masks the
logits to a grammar (llguidance); ``promptlookup`` guesses the next tokens
from a sequence's own context; ``rewind`` takes back the tokens a draft got wrong,
and ``replay`` puts recurrent states back and feeds them the right ones again.
"""
