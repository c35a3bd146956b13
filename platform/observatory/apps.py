from django.apps import AppConfig


class ObservatoryConfig(AppConfig):
    name = "observatory"
