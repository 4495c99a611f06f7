"""A conversation as the model sees it: roles, message boundaries, echoed history, tool formats, max tokens.

``roles`` maps API roles onto a template's; ``boundaries`` finds where each
message starts in the rendered tokens; ``echo`` reuses the reply tokens an
agent was given when a client sends the reply back; ``toolformat`` renders
tools and parses calls with mlx-lm's parsers; ``maxtokens`` fits a turn's
``max_tokens`` to what the context and the pool leave.
"""
