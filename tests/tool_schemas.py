"""The two function tools every tool-call test offers (weather and time), their parameter
schemas by name, and the question that calls for the first; each API's test wraps them in its
own tool format."""

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "minLength": 1, "maxLength": 10}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
