"""OpenAI's chat and completions APIs: ``protocol`` (the request and reply shapes), ``messages`` (into the one
conversation form), ``router`` (route to turn to reply, streamed or whole)."""
