"""OpenAI's Responses API: ``protocol`` (the request and reply shapes), ``messages`` (input items into the one
conversation form), ``router`` (route to turn to reply), ``store`` (stored responses for ``previous_response_id``)."""
